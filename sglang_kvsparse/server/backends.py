"""Which of SGLang's attention backends can run the full layers beside the sparse ones.

A sparse server wraps the stock backend (`patches/attention.py`): full layers call it unchanged,
sparse layers the project's kernels. The wrapper only forwards calls, so any backend for
ordinary multi-head (MHA/GQA) attention works as the inner one, including SGLang's own default
on each device (`fa3` on Hopper, `flashinfer` on other NVIDIA GPUs, `aiter` on AMD, `intel_amx`
or `torch_native` on a CPU). Backends built for other attention kinds (MLA, DeepSeek's sparse
attention, model-specific ones) cannot be the inner one: the sparse layers do not serve those
models. No SGLang imports: the launcher decides before SGLang starts.
"""

from __future__ import annotations

#: SGLang 0.5.23's backends for MHA/GQA models, each wrapped for a sparse server.
WRAPPED_BACKENDS: tuple[str, ...] = (
    "torch_native",
    "triton",
    "flex_attention",
    "fa3",
    "fa4",
    "flashinfer",
    "trtllm_mha",
    "hpc_ops",
    "aiter",
    "wave",
    "intel_amx",
    "ascend",
    "intel_xpu",
)

#: The nearest backend that runs on every device of its kind, for a flag that cannot work.
FALLBACK_BACKEND = {"cpu": "torch_native", "gpu": "triton"}

#: SGLang's options that name an attention backend (ServerArgs field spelling).
BACKEND_OPTIONS: tuple[str, ...] = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def backend_choices(given: dict[str, object], *, cpu: bool) -> tuple[dict[str, str], list[str]]:
    """(options to override, one line per override) for the backend options the user gave.

    Unset options stay SGLang's to choose (its default is always wrapped); a given backend that
    cannot run beside the sparse layers is replaced by `FALLBACK_BACKEND` for the device.
    """
    fallback = FALLBACK_BACKEND["cpu" if cpu else "gpu"]
    overrides: dict[str, str] = {}
    lines: list[str] = []
    for option in BACKEND_OPTIONS:
        name = given.get(option)
        if name is None or name in WRAPPED_BACKENDS:
            continue
        overrides[option] = fallback
        flag = "--" + option.replace("_", "-")
        lines.append(f"{flag} {name} cannot run beside sparse layers (it is not an MHA/GQA backend): using {fallback}")
    return overrides, lines
