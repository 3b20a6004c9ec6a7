"""eval/ablate.py: recipe configs (overrides, calibration options, rotations) and a whole run on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from eval import ablate
from oscar_hf.config import METHODS
from tests.conftest import tiny_model
from tests.test_niah import VOCAB, byte_tokenizer, write_essays

SMALL = {"sink": 4, "recent": 16, "block": 4}


def test_overrides_reach_nested_fields_and_dtypes():
    config = ablate.recipe_config(
        {
            "label": "x",
            "method": "oscar-int2",
            "overrides": {
                "recent": 128,
                "key": {"group_size": 32},
                "value": {"clip_ratio": 0.0},
                "metadata_dtype": "float32",
            },
        }
    )
    assert (
        config.recent == 128
        and config.key.group_size == 32
        and config.key.clip_ratio == METHODS["oscar-int2"].key.clip_ratio
    )
    assert config.value.clip_ratio == 0.0 and config.value.bits == 2 and config.metadata_dtype == torch.float32
    with pytest.raises(ValueError, match="unknown OscarCache option"):
        ablate.recipe_config({"label": "x", "method": "int4", "overrides": {"recnet": 1}})
    with pytest.raises(ValueError, match="override 'key' of none takes no fields"):
        ablate.recipe_config({"label": "x", "method": "none", "overrides": {"key": {"bits": 4}}})
    with pytest.raises(ValueError, match="unknown method"):
        ablate.recipe_config({"label": "x", "method": "int3"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['factors'\]"):
        ablate.recipe_config({"label": "x", "method": "oscar-int2", "factors": "HP"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['depth'\], missing \['depths'\]"):
        ablate.needle_settings({"lengths": [2048], "depth": [50], "needles": 1})
    with pytest.raises(ValueError, match="leave the key out for no needles"):
        ablate.needle_settings(None)


def test_windows_per_context():
    assert ablate.per_context({"context": 2048, "windows": 3}) == [(2048, 3)]
    assert ablate.per_context({"context": [2048, 8192], "windows": [6, 2]}) == [(2048, 6), (8192, 2)]
    with pytest.raises(ValueError, match="one per context"):
        ablate.per_context({"context": [2048, 8192], "windows": [6]})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A whole run of every section on a tiny Llama with the byte tokenizer and synthetic data."""
    root = tmp_path_factory.mktemp("ablate")
    model_dir = root / "model"
    tiny_model("llama", vocab_size=VOCAB).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    data = write_essays(root / "data")
    (data / "held_out.txt").write_text(" ".join(f"Line {k} of the held-out text." for k in range(200)))
    (data / "calibration.txt").write_text(" ".join(f"Calibration sentence {k}." for k in range(300)))
    config = {
        "description": "tiny run",
        "model": str(model_dir),
        "context": [96, 128],
        "windows": [2, 1],
        "calibrations": {"text": {"files": ["calibration.txt"], "chars": [0, None], "tokens": 600, "seq_len": 200}},
        "eval_texts": {"held_out": {"file": "held_out.txt", "chars": [100, None]}},
        "needles": {"lengths": [480, 520], "depths": [0, 50], "needles": 1, "max_new_tokens": 4, "batch_size": 2},
        "variants": [
            {"label": "none", "method": "none", "overrides": SMALL},
            {"label": "naive G=8", "method": "naive-int2", "overrides": {**SMALL, "key": {"group_size": 8}}},
            {
                "label": "calibrated HP",
                "method": "oscar-int2",
                "calibration": "text",
                "calibrate": {"factors": "HP"},
                "overrides": SMALL,
            },
            {
                "label": "clip search",
                "method": "oscar-int2",
                "calibration": "text",
                "clip_search": {"grid": [1.0, 0.9], "max_queries": 16},
                "overrides": SMALL,
            },
        ],
    }
    path = root / "tiny.json"
    path.write_text(json.dumps(config))
    stem = root / "out" / "tiny"
    result = ablate.main(["--config", str(path), "--data-dir", str(data), "--device", "cpu", "--out", str(stem)])
    return result, stem


def test_a_run_reports_memory_kl_and_needles_per_recipe(run):
    result, stem = run
    labels = ["none", "naive G=8", "calibrated HP", "clip search"]
    assert result["variants"] == labels
    memory = result["bits_per_element"]
    assert set(memory["none"]) == {"96", "128", "480", "520", "131072@hd128"} and memory["none"]["128"] == 16.0
    assert memory["naive G=8"]["131072@hd128"] > memory["clip search"]["131072@hd128"]  # 8 channels per scale and zero
    assert set(result["scores"]["held_out"]) == {"96", "128"}
    assert result["scores"]["held_out"]["128"]["none"]["kl_from_none"] == 0.0
    assert all(result["scores"]["held_out"]["96"][label]["kl_from_none"] > 0 for label in labels[1:])
    summary = result["needles"]["summary"]
    assert set(summary) == set(labels) and summary["clip search"]["by_length"]["520"]["trials"] == 2
    assert len(result["needles"]["trials"]) == 16 and result["needles"]["seconds"]["none"].keys() == {480, 520}
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert saved["date"].endswith("UTC") and saved["machine"]["cpu_count"] and saved["dtype"] == "float32"
    markdown = stem.with_suffix(".md").read_text()
    assert "| calibrated HP |" in markdown and "EM 480" in markdown and "BPE 128K hd128" in markdown
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_recipes_raise_clear_errors():
    with pytest.raises(ValueError, match="either rotations or calibration"):
        ablate.variant_cache(
            None, {"label": "x", "method": "oscar-int2", "rotations": "default", "calibration": "a"}, {}
        )
    with pytest.raises(ValueError, match="need a calibration"):
        ablate.variant_cache(None, {"label": "x", "method": "oscar-int2", "clip_search": True}, {})


def test_a_variant_that_allocates_bits_gets_per_layer_widths():
    """``calibrate.allocate_bits`` reaches the variant's rotations, as ``oscar_hf.calibrate`` applies it."""
    from oscar_hf.calibration.covariances import collect_covariances

    model = tiny_model("llama")
    torch.manual_seed(0)
    batches = [torch.randint(3, 256, (1, 400)) for _ in range(2)]  # longer than oscar-int2's windows
    calibrations = {"text": (collect_covariances(model, batches, progress=False), batches, lambda recipe: batches)}
    variant = {"label": "allocated", "method": "oscar-int2", "calibration": "text", "clip_search": True}
    plain = ablate.variant_cache(model, variant, calibrations)
    assert [(layer.config.key.bits, layer.config.value.bits) for layer in plain.layers] == [(2, 2), (2, 2)]
    only4 = {"allocate_bits": 1, "allocate_key_bits": [4]}
    allocated = ablate.variant_cache(model, {**variant, "calibrate": only4}, calibrations)
    widths = [(layer.config.key.bits, layer.config.value.bits) for layer in allocated.layers]
    assert sorted(widths) == [(2, 1), (4, 1)]  # one layer of 4-bit keys, paid for by two of 1-bit values
    allocated = ablate.variant_cache(model, {**variant, "calibrate": {"allocate_bits": 1}}, calibrations)
    widths = [(layer.config.key.bits, layer.config.value.bits) for layer in allocated.layers]
    assert sorted(widths) in ([(2, 1), (4, 1)], [(3, 1), (3, 1)])  # the same bits, as 4-bit keys or two 3-bit
    with pytest.raises(ValueError, match="not calibrate.from_rotations"):
        ablate.variant_cache(model, {**variant, "calibrate": {"allocate_bits": 1, "from_rotations": "x"}}, calibrations)


def test_a_variant_respends_a_saved_sets_recorded_allocation(tmp_path):
    """``allocate_bits`` beside ``rotations``: the widths the set's recorded scores give for that budget."""
    from oscar_hf import RotationSet
    from oscar_hf.calibration.bit_allocation import BitAllocation
    from oscar_hf.rotations.files import save_rotations

    model = tiny_model("llama", num_hidden_layers=4)
    recorded = BitAllocation(
        0.1, {4: {0: 0.01, 1: 0.03, 2: 0.02, 3: 0.0}}, {0: 0.002, 1: 0.001, 2: 0.004, 3: 0.003}, {1: 4}, [0, 1]
    )
    rotations = recorded.widths_of(RotationSet.hadamard(16, [0, 1, 2, 3]))
    save_rotations(rotations, tmp_path / "saved", {"bit_allocation": recorded.to_dict()})
    variant = {"label": "N=2", "method": "oscar-int2", "rotations": str(tmp_path / "saved"), "allocate_bits": 2}
    cache = ablate.variant_cache(model, variant, {})
    widths = [(layer.config.key.bits, layer.config.value.bits) for layer in cache.layers]
    assert widths == [(2, 1), (4, 1), (4, 1), (2, 1)]  # K4 where it gains most, V1 in all four layers
    one_layer = [
        (layer.config.key.bits, layer.config.value.bits)
        for layer in ablate.variant_cache(model, {**variant, "allocate_bits": 1}, {}).layers
    ]
    assert one_layer == [(2, 1), (4, 1), (2, 2), (2, 2)]
    save_rotations(rotations, tmp_path / "unscored")
    with pytest.raises(ValueError, match="records a bit allocation"):
        ablate.variant_cache(model, {**variant, "rotations": str(tmp_path / "unscored")}, {})
    with pytest.raises(ValueError, match="give rotations"):
        ablate.variant_cache(model, {"label": "x", "method": "oscar-int2", "allocate_bits": 1}, {})
