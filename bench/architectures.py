"""Every architecture the docs list as supported, served once with sparsity on (issue 15).

  .venv/bin/python bench/architectures.py [--out-dir DIR]     # about 5 minutes on 2 cores

For each architecture in `SUPPORTED`: a dummy-weight model of that architecture (a tiny shape:
4 layers, 2 KV heads; the architecture's own keys as in its public config.json) is started with
the project's launcher, layer 0 full and a budget of 64 in the others; one greedy request of a
300-token prompt and 80 new tokens runs, so the sparse layers select at prefill and evict while
decoding; then the server must be idle with every heap row back (after a cache flush). For each
architecture in `REFUSED`, the launcher must refuse it in one line before SGLang starts.
Writes ``<out-dir>/architectures-<date>.{json,md}``, the servers' logs in ``architectures-<date>-logs/``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from common.report import ReportPaths, provenance_line, write_json
from common.systems import ServerSettings, server_for, shared_server_args

from kvsparse_testbed.dummy_models import SHAPES, write_dummy_model
from kvsparse_testbed.server import ServerStartError

ROOT = Path(__file__).resolve().parent.parent

SHAPE = {
    **SHAPES["dry-run"],
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

#: Architectures served with sparsity on, with the keys their public configs set. (Qwen2 is not
#: here: stock SGLang 0.5.23 itself fails to serve a dummy-weight Qwen2 on the CPU, in its rotary
#: embedding on an empty batch, so this machine cannot try it.)
SUPPORTED: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"model_type": "llama", "hidden_act": "silu", "rope_theta": 500000.0},
    "MistralForCausalLM": {"model_type": "mistral", "hidden_act": "silu", "sliding_window": None},
    "Qwen3ForCausalLM": {"model_type": "qwen3", "hidden_act": "silu", "tie_word_embeddings": True},
    "GemmaForCausalLM": {"model_type": "gemma", "hidden_act": "gelu_pytorch_tanh", "head_dim": 64},
    # Sliding-window layers 0 and 2 (a window shorter than the prompt: the window path), layers 1 and
    # 3 global: the listed full layer 0 slides, so layer 1 is full for it and layer 3 is sparse.
    "Gemma3ForCausalLM": {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
    },
    # A window as long as the context (Ministral-8B-2410's 32,768 of 32,768): full attention.
    "Mistral-window-of-context": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "sliding_window": SHAPE["max_position_embeddings"],
    },
}

#: Architectures the launcher must refuse (see `sglang_kvsparse/server/model_support.py`).
REFUSED: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {"model_type": "gemma2", "sliding_window": 4096, "attn_logit_softcapping": 50.0},
    "DeepseekV3ForCausalLM": {"model_type": "deepseek_v3", "kv_lora_rank": 512, "q_lora_rank": 1536},
    "GptOssForCausalLM": {
        "model_type": "gpt_oss",
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_local_experts": 4,
    },
}

SPARSITY = ("--kvsparse-full-layers", "0", "--kvsparse-budget", "64")
PROMPT_LEN, NEW_TOKENS = 300, 80


def say(message: str) -> None:
    print(f"[architectures] {message}", flush=True)


def model_folder(work: Path, architecture: str, keys: dict[str, Any]) -> Path:
    return write_dummy_model(work / architecture, {**SHAPE, "architectures": [architecture], **keys})


def serve_once(architecture: str, folder: Path, log_dir: Path) -> dict[str, Any]:
    """Start, one request, idle with every heap row back, stop; what happened."""
    settings = ServerSettings(architecture, "auto", "float32", 16384, None, 10, 600.0)
    shared = shared_server_args(settings, folder, ["--load-format", "dummy"])
    result: dict[str, Any] = {"architecture": architecture, "served": False, "error": None}
    server = server_for(architecture, SPARSITY, shared, settings, log_dir, say)
    try:
        with server:
            url = server.base_url
            payload = {
                "input_ids": [3 + (i * 7919) % 31000 for i in range(PROMPT_LEN)],
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            }
            answer = requests.post(f"{url}/generate", json=payload, timeout=600).json()
            stats = requests.get(f"{url}/kvsparse/stats", timeout=60).json()
            requests.post(f"{url}/flush_cache", timeout=60)
            time.sleep(1)
            heap = requests.get(f"{url}/kvsparse/stats", timeout=60).json()["heap"]
            kinds = [layer["kind"] for layer in stats["replicas"][0]["tp_ranks"][0]["layers"]]
            result.update(
                layer_kinds={kind: kinds.count(kind) for kind in sorted(set(kinds))},
                output_tokens=len(answer.get("output_ids", [])),
                evictions=stats["evictions"],
                requests_running_after=stats["requests_running"],
                heap_rows_back=heap["free"] == heap["rows_total"],
            )
            result["served"] = (
                result["output_tokens"] == NEW_TOKENS
                and result["evictions"] > 0
                and result["requests_running_after"] == 0
                and result["heap_rows_back"]
            )
    except (ServerStartError, requests.RequestException, KeyError) as exc:
        result["error"] = str(exc).splitlines()[0]
    return result


def refused_once(architecture: str, folder: Path) -> dict[str, Any]:
    """The launcher's answer (no SGLang start): exit status 2 and one `error:` line."""
    run = subprocess.run(
        [sys.executable, "-m", "sglang_kvsparse.launch_server", "--model-path", str(folder), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    return {
        "architecture": architecture,
        "returncode": run.returncode,
        "error_line": errors[0] if errors else None,
        "refused": run.returncode == 2 and len(errors) == 1 and "cannot serve" in errors[0],
    }


def write_report(paths: ReportPaths, report: dict[str, Any]) -> None:
    write_json(paths, report)
    lines = [
        f"# Architectures served with sparsity on, {report['date']}",
        provenance_line(report),
        "",
        f"Written by `bench/architectures.py`. Dummy weights, a tiny shape ({json.dumps(SHAPE)}), "
        f"the project's launcher with `{' '.join(SPARSITY)}`, one greedy request of {PROMPT_LEN} "
        f"tokens and {NEW_TOKENS} new ones (the sparse layers select at prefill and evict while "
        "decoding), then idle with every heap row back after a cache flush.",
        "",
        "| architecture | served | layers by kind | output tokens | evictions | heap rows back | error |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for row in report["supported"]:
        lines.append(
            f"| {row['architecture']} | {'yes' if row['served'] else '**no**'} "
            f"| {', '.join(f'{n} {kind}' for kind, n in row.get('layer_kinds', {}).items())} "
            f"| {row.get('output_tokens', '')} "
            f"| {row.get('evictions', '')} | {row.get('heap_rows_back', '')} | {row['error'] or ''} |"
        )
    lines += ["", "Refused by the launcher before SGLang starts:", "", "| architecture | refused | the line |"]
    lines.append("|---|---|---|")
    for row in report["refused"]:
        lines.append(f"| {row['architecture']} | {'yes' if row['refused'] else '**no**'} | `{row['error_line']}` |")
    paths.markdown.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    date = dt.date.today().isoformat()
    paths = ReportPaths(args.out_dir, f"architectures-{date}")
    report: dict[str, Any] = {"date": date, "supported": [], "refused": []}
    log_dir = args.out_dir / f"architectures-{date}-logs"
    log_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvsparse-arch-") as work:
        for architecture, keys in REFUSED.items():
            report["refused"].append(refused_once(architecture, model_folder(Path(work), architecture, keys)))
            say(f"{architecture}: {'refused' if report['refused'][-1]['refused'] else 'NOT refused'}")
        for architecture, keys in SUPPORTED.items():
            say(f"{architecture}: starting")
            report["supported"].append(serve_once(architecture, model_folder(Path(work), architecture, keys), log_dir))
            row = report["supported"][-1]
            say(f"{architecture}: {'served' if row['served'] else 'FAILED ' + str(row['error'] or row)}")
            write_report(paths, report)
        write_report(paths, report)
    say(f"wrote {paths.json} and {paths.markdown.name}")
    ok = all(row["served"] for row in report["supported"]) and all(row["refused"] for row in report["refused"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
