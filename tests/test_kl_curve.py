"""KL from BF16 vs context length: per-position statistics, bucket math, agreement with ``eval kl``, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from oscar_hf.cli.main import main
from oscar_hf.evaluation.kl import evaluate_methods
from oscar_hf.evaluation.kl_curve import (
    at_contexts,
    buckets,
    default_contexts,
    kl_curve_markdown,
    kl_curve_result,
    plot_kl_curve,
    position_stats,
)
from oscar_hf.evaluation.report import write_outputs
from oscar_hf.provenance import provenance, provenance_line
from tests.conftest import tiny_model

WINDOWS = dict(sink=4, recent=16, block=4)  # first quantized key seen at position 4 + 16 + 4 - 1
CTX = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def token_ids():
    return torch.randint(3, 256, (600,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def stats(model, token_ids):
    return position_stats(
        model, token_ids, ["none", "int4", "naive-int2"], context=CTX, windows=2, progress=False, **WINDOWS
    )


def test_none_has_zero_kl_and_quantized_methods_positive_kl_after_the_windows(stats):
    per_method, starts, first = stats
    assert first == 20 and starts == [0, 600 - CTX]
    for method, s in per_method.items():
        assert s.shape == (3, CTX - 1)
    none, int4, naive = per_method["none"], per_method["int4"], per_method["naive-int2"]
    assert torch.all(none[1] == 0) and torch.all(none[2] == 1)
    # before the first demotion (query 23 is the first to see a quantized key) nothing differs from BF16
    assert naive[1, :23].abs().max() < 1e-5 and int4[1, :23].abs().max() < 1e-5
    assert naive[1, 23:].mean() > 0 and int4[1, 23:].mean() > 0
    assert naive[1, 23:].mean() > int4[1, 23:].mean()  # 2-bit without rotation is worse than 4-bit
    assert torch.all(per_method["none"][0] > 0)  # NLL


def test_curve_at_full_context_equals_eval_kl(model, token_ids, stats):
    """``at_contexts`` at C = window length is what evaluate_methods (``eval kl``) scores on the same windows."""
    per_method, _, first = stats
    scores = {
        s.method: s
        for s in evaluate_methods(
            model, token_ids, ["none", "int4", "naive-int2"], context=CTX, windows=2, progress=False, **WINDOWS
        )
    }
    for method in ("none", "int4", "naive-int2"):
        point = at_contexts(per_method[method], first, [CTX])[str(CTX)]
        assert point["positions"] == scores[method].positions // 2
        assert point["kl"] == pytest.approx(scores[method].kl_from_none, abs=2e-5)
        assert point["top1_agreement"] == pytest.approx(scores[method].top1_agreement, abs=1e-3)
        assert point["perplexity"] == pytest.approx(scores[method].perplexity, rel=1e-3)


def test_bucket_and_context_math_on_known_numbers():
    positions = torch.arange(10, dtype=torch.float64)
    stats = torch.stack([torch.zeros(10), positions, torch.ones(10)])  # nll 0, kl = position, top1 1
    out = buckets(stats, 4)
    assert [(b["start"], b["end"]) for b in out] == [(0, 4), (4, 8), (8, 10)]
    assert [b["kl"] for b in out] == [1.5, 5.5, 8.5]
    assert all(b["perplexity"] == 1.0 and b["top1_agreement"] == 1.0 for b in out)
    points = at_contexts(stats, 2, [5, 11, 64])
    assert points == {
        "5": {"kl": 2.5, "top1_agreement": 1.0, "perplexity": 1.0, "positions": 2},  # positions 2, 3
        "11": {"kl": 5.5, "top1_agreement": 1.0, "perplexity": 1.0, "positions": 8},  # positions 2..9
    }  # 64 needs more positions than there are
    assert default_contexts(8192) == [512, 1024, 2048, 4096, 8192]
    assert default_contexts(3000) == [512, 1024, 2048, 3000]


def test_result_markdown_and_png(tmp_path, stats):
    per_method, starts, first = stats
    meta = {**provenance("pytest"), "seconds": 1}
    settings = {
        "model": "tiny",
        "text": "random",
        "text_tokens": 600,
        "ctx": CTX,
        "windows": 2,
        "methods": list(per_method),
    }
    result = kl_curve_result(per_method, starts, first, 32, meta, settings)
    assert [(b["start"], b["end"]) for b in result["curves"]["int4"]] == [(0, 32), (32, 64), (64, 95)]
    assert set(result["at_context"]["int4"]) == {str(CTX)}
    assert result["curves"]["none"][2]["kl"] == 0
    markdown = kl_curve_markdown(result)
    assert "| naive-int2 | " in markdown and "| 64-94 | " in markdown and provenance_line(meta) in markdown
    paths = write_outputs(result, tmp_path / "curve", markdown, plot_kl_curve)
    assert json.loads(paths[0].read_text())["curves"]["int4"][0]["kl"] == pytest.approx(0, abs=1e-5)
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not math.isnan(result["at_context"]["naive-int2"][str(CTX)]["kl"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model):
    from tests.test_niah import byte_tokenizer

    folder = tmp_path_factory.mktemp("tiny_llama_curve")
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_cli_writes_outputs_and_refuses_bad_input(tmp_path, model_dir, capsys, monkeypatch):
    text = tmp_path / "text.txt"
    text.write_text("All work and no play makes a dull model. " * 30, encoding="utf-8")
    stem = tmp_path / "out" / "curve"
    main(
        [
            "eval",
            "kl-curve",
            "--model",
            str(model_dir),
            "--text",
            str(text),
            "--ctx",
            "400",
            "--windows",
            "1",
            "--bucket",
            "100",
            "--methods",
            "none,naive-int2",
            "--out",
            str(stem),
        ]
    )
    result = json.loads(stem.with_suffix(".json").read_text())
    assert result["first_scored"] == 320 and result["window_starts"] == [0]
    assert [b["end"] for b in result["curves"]["naive-int2"]] == [100, 200, 300, 399]
    assert result["curves"]["naive-int2"][-1]["kl"] > 0 and result["at_context"]["naive-int2"]["400"]["kl"] > 0
    assert stem.with_suffix(".png").is_file() and "| naive-int2 |" in capsys.readouterr().out

    with pytest.raises(SystemExit, match="exceeds the model's context of 2048"):
        main(["eval", "kl-curve", "--model", str(model_dir), "--text", str(text), "--ctx", "4096"])
    with pytest.raises(SystemExit, match="fewer than --ctx 2000"):
        main(["eval", "kl-curve", "--model", str(model_dir), "--text", str(text), "--ctx", "2000"])
    with pytest.raises(SystemExit, match="is not a file"):
        main(["eval", "kl-curve", "--model", str(model_dir), "--text", str(tmp_path / "missing.txt")])
    with pytest.raises(SystemExit) as error:
        main(["eval", "kl-curve", "--model", str(model_dir), "--text", str(text), "--methods", "int3"])
    assert error.value.code == 2 and "unknown method" in capsys.readouterr().err
    monkeypatch.delenv("OSCAR_HF_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="no --text and no data directory"):
        main(["eval", "kl-curve", "--model", str(model_dir)])
