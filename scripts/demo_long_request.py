"""Part of `make demo`: one long request, what the sparse layers hold while it decodes, and a
second request that reuses its prefix.

Streams a summary of ~3,000 tokens of essays from the running server and, a few tokens into the
decode, reads `GET /kvsparse/stats`: the slots each kind of layer holds and the request's KV bytes
beside what stock SGLang would hold for it. Then asks another question about the same essays: the
radix cache serves the shared prefix (sparse layers included), so only the new tokens are computed.
"""

from __future__ import annotations

import json
import sys
import time

import requests

from kvsparse_testbed.texts import essay_text

MIB = 1 << 20


def main(url: str) -> None:
    essays = essay_text(13000)[:13000]
    prompt = essays + "\n\nSummarize the essays above in two sentences.\n"
    payload = {"text": prompt, "sampling_params": {"max_new_tokens": 48, "temperature": 0}, "stream": True}
    print("[demo] POST /generate with a ~3,000-token prompt (prefill takes a few seconds on a CPU)")
    stats, text = None, ""
    with requests.post(f"{url}/generate", json=payload, stream=True, timeout=600) as response:
        response.raise_for_status()
        for i, line in enumerate(raw for raw in response.iter_lines() if raw.startswith(b"data: {")):
            chunk = json.loads(line[len(b"data: ") :])
            text = chunk["text"]
            if i == 8:
                stats = requests.get(f"{url}/kvsparse/stats", timeout=120).json()
    print(f"[demo] answer: {text.strip()}")
    if not stats or not stats.get("enabled"):
        print("[demo] sparsity off: no per-layer stats")
        return
    by_kind: dict[str, list[int]] = {}
    for layer in stats["layers"]:
        by_kind.setdefault(layer["kind"], []).append(layer["slots_in_use"])
    held = ", ".join(f"{len(v)} {kind} layers hold {max(v)} slots each" for kind, v in by_kind.items())
    print(f"[demo] while decoding: {held}")
    print(
        f"[demo] KV bytes of the running request: {stats['kv_bytes_in_use'] / MIB:.1f} MiB "
        f"(stock SGLang: {stats['kv_bytes_if_dense'] / MIB:.1f} MiB)"
    )
    followup = {
        "text": essays + "\n\nWho wrote the essays above?\n",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0},
    }
    started = time.monotonic()
    answer = requests.post(f"{url}/generate", json=followup, timeout=600).json()
    meta = answer["meta_info"]
    print(
        f"[demo] a second question about the same essays: {meta['cached_tokens']} of its "
        f"{meta['prompt_tokens']} prompt tokens came from the radix cache, answered in "
        f"{time.monotonic() - started:.1f} s: {answer['text'].strip()!r}"
    )


if __name__ == "__main__":
    main(sys.argv[1])
