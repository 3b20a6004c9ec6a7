"""Per-layer bit allocation: layers ranked by teacher-forced KL, K4 in the top N and V1 in the 2N cheapest."""

from __future__ import annotations

import json

import pytest
import torch

from oscar_hf import OscarCache, RotationSet
from oscar_hf.rotations.bit_allocation import allocate_bits
from oscar_hf.core.config import METHODS
from oscar_hf.core.teacher_forcing import position_stats_of_caches
from tests.conftest import tiny_model

SMALL = METHODS["oscar-int2"].with_overrides(sink=4, recent=8, block=2)


def _rows(count: int, length: int) -> list[torch.Tensor]:
    return [torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(s)) for s in range(count)]


def test_the_allocation_follows_the_measured_kl_and_keeps_the_budget():
    model = tiny_model("llama", num_hidden_layers=4)
    rotations = RotationSet.hadamard(16, [0, 1, 2, 3])
    rotations.key_clip.update({i: 0.9 for i in range(4)})
    batches = _rows(2, 48)
    allocated, scores = allocate_bits(model, batches, rotations, 1, SMALL, progress=False)
    assert sorted(scores.key_gain) == sorted(scores.value_cost) == [0, 1, 2, 3]
    assert scores.key_layers == [max(scores.key_gain, key=scores.key_gain.get)]
    assert scores.value_layers == sorted(sorted(scores.value_cost, key=scores.value_cost.get)[:2])
    assert allocated.key_bits == {scores.key_layers[0]: 4}
    assert allocated.value_bits == dict.fromkeys(scores.value_layers, 1)
    assert allocated.key_clip == rotations.key_clip and rotations.key_bits == {}  # the input set is left alone
    # the scores are the KL of the evaluation code: one layer's 1-bit values measured again
    layer = scores.value_layers[0]
    probe = RotationSet(16, rotations.key, rotations.value, key_clip=rotations.key_clip, value_bits={layer: 1})
    caches = {"base": OscarCache(model, SMALL, rotations=rotations),
              "v1": OscarCache(model, SMALL, rotations=probe, allow_bits_change=True)}  # fmt: skip
    stats, _ = position_stats_of_caches(model, torch.cat([b[0] for b in batches]), caches, 48, 2, progress=False)
    cost = float(stats["v1"][1, 12:].mean() - stats["base"][1, 12:].mean())
    assert cost == pytest.approx(scores.value_cost[layer], rel=1e-6, abs=1e-9)
    assert scores.allocated_kl is not None and scores.positions == (48 - 1 - 12) * 2
    cache = OscarCache(model, SMALL, rotations=allocated)  # within oscar-int2's budget: no override needed
    assert sum(layer.config.key.bits + layer.config.value.bits for layer in cache.layers) == 16


def test_the_allocation_validates_its_inputs():
    model = tiny_model("llama")
    rotations = RotationSet.hadamard(16, [0, 1])
    with pytest.raises(ValueError, match="1 to 1 layers"):
        allocate_bits(model, _rows(1, 40), rotations, 2, SMALL, progress=False)
    with pytest.raises(ValueError, match="longer than sink"):
        allocate_bits(model, _rows(1, 12), rotations, 1, SMALL, progress=False)
    with pytest.raises(ValueError, match="2-bit widths"):
        allocate_bits(model, _rows(1, 40), rotations, 1, METHODS["oscar-k4v2"], progress=False)


def test_calibrate_command_allocates_bits(tmp_path, capsys):
    """``oscar-hf calibrate --clip-search --allocate-bits 1`` on a saved tiny model: widths in the rotation file."""
    from transformers import AutoTokenizer

    from oscar_hf.cli.main import main
    from oscar_hf.core.models import _default_checkpoint
    from oscar_hf.rotations.files import load_rotation_config
    from oscar_hf.rotations.hub import load_rotations

    tokenizer = AutoTokenizer.from_pretrained(_default_checkpoint())
    model_dir = tmp_path / "model"
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "text.txt"
    data.write_text(" ".join(f"Line {i}: the harbour, the bridge and the cliffs of the northern coast." for i in range(200)))
    out = tmp_path / "rotations"
    main(["calibrate", "--model", str(model_dir), "--data", str(data), "--tokens", "800", "--seq-len", "400",
          "--clip-search", "--allocate-bits", "1", "--out", str(out), "--json"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    allocation = summary["bit_allocation"]
    assert len(allocation["key_4bit_layers"]) == 1 and allocation["value_1bit_layers"] == [0, 1]
    assert summary["per_layer"][0]["value_bits"] == 1
    rotations = load_rotations(out)
    assert rotations.key_bits == dict.fromkeys(allocation["key_4bit_layers"], 4) and rotations.value_bits == {0: 1, 1: 1}
    assert len(rotations.key_clip) == 2
    stored = load_rotation_config(out)["bit_allocation"]
    assert set(stored["key_gain"]) == {"0", "1"} and stored["baseline_kl"] == allocation["baseline_kl"]
    with pytest.raises(SystemExit, match="drop --no-clip-search"):
        main(["calibrate", "--model", str(model_dir), "--data", str(data), "--no-clip-search", "--allocate-bits", "1",
              "--out", str(out)])  # fmt: skip
