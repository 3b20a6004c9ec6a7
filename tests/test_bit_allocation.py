"""Per-layer bit allocation: layers scored by teacher-forced KL, the bits of K4 in N layers spent on the key widths
that gain most and V1 in the cheapest layers that pay for them (2N against oscar-int2's widths, N against
oscar-k3v2's)."""

from __future__ import annotations

import json

import pytest
import torch

from oscar_hf import OscarCache, Recipe, RotationSet
from oscar_hf.calibration.bit_allocation import BitAllocation, allocate_bits, widest_gain
from oscar_hf.calibration.clip_search import CLIP_GRID
from oscar_hf.calibration.teacher_forcing import position_stats_of_caches
from oscar_hf.config import METHODS, TensorQuantConfig
from tests.conftest import run_calibrate, saved_tiny_model, tiny_model

SMALL = METHODS["oscar-int2"].with_overrides(sink=4, recent=8, block=2)
SMALL_K3V2 = METHODS["oscar-k3v2"].with_overrides(sink=4, recent=8, block=2)


def _rows(count: int, length: int) -> list[torch.Tensor]:
    return [torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(s)) for s in range(count)]


def test_the_allocation_follows_the_measured_kl_and_keeps_the_budget():
    model = tiny_model("llama", num_hidden_layers=4)
    rotations = RotationSet.hadamard(16, [0, 1, 2, 3])
    rotations.key_clip.update({i: 0.9 for i in range(4)})
    batches = _rows(2, 48)
    allocated, scores = allocate_bits(model, batches, rotations, 1, SMALL, progress=False)  # widths 3 and 4
    assert sorted(scores.key_gain) == [3, 4]
    assert sorted(scores.key_gain[3]) == sorted(scores.key_gain[4]) == sorted(scores.value_cost) == [0, 1, 2, 3]
    assert scores.key_bits == widest_gain(scores.key_gain, 2, 2)
    assert sum(bits - 2 for bits in scores.key_bits.values()) == 2  # the bits of one 4-bit key layer
    assert scores.value_layers == sorted(sorted(scores.value_cost, key=scores.value_cost.get)[:2])
    assert allocated.key_bits == scores.key_bits
    assert allocated.value_bits == dict.fromkeys(scores.value_layers, 1)
    assert allocated.key_clip == rotations.key_clip and rotations.key_bits == {}  # the input set is left alone
    # 4-bit keys only: one layer, the one of largest 4-bit gain
    _, only4 = allocate_bits(model, batches, rotations, 1, SMALL, key_widths=(4,), progress=False)
    assert list(only4.key_gain) == [4] and only4.key_gain[4] == scores.key_gain[4]
    assert only4.key_bits == {max(scores.key_gain[4], key=scores.key_gain[4].get): 4}
    # the scores are the KL of the evaluation code: one layer's 1-bit values measured again
    layer = scores.value_layers[0]
    probe = RotationSet(16, rotations.key, rotations.value, key_clip=rotations.key_clip, value_bits={layer: 1})
    caches = {
        "base": OscarCache(model, SMALL, rotations=rotations),
        "v1": OscarCache(model, SMALL, rotations=probe, allow_bits_change=True),
    }
    stats, _ = position_stats_of_caches(model, torch.cat([b[0] for b in batches]), caches, 48, 2, progress=False)
    cost = float(stats["v1"][1, 12:].mean() - stats["base"][1, 12:].mean())
    assert cost == pytest.approx(scores.value_cost[layer], rel=1e-6, abs=1e-9)
    assert scores.allocated_kl is not None and scores.positions == (48 - 1 - 12) * 2
    cache = OscarCache(model, SMALL, rotations=allocated)  # within oscar-int2's budget: no override needed
    assert sum(layer.config.key.bits + layer.config.value.bits for layer in cache.layers) == 16


def test_an_allocation_for_k3v2_trades_one_value_layer_per_key_layer():
    model = tiny_model("llama", num_hidden_layers=4)
    rotations = RotationSet.hadamard(16, [0, 1, 2, 3])
    rotations.value_clip.update({i: 0.9 for i in range(4)})
    batches = _rows(2, 48)
    allocated, scores = allocate_bits(model, batches, rotations, 2, SMALL_K3V2, progress=False)
    assert list(scores.key_gain) == [4]  # the only width above K3
    top = sorted(sorted(scores.key_gain[4], key=lambda i: -scores.key_gain[4][i])[:2])
    assert scores.key_bits == dict.fromkeys(top, 4)
    assert scores.value_layers == sorted(sorted(scores.value_cost, key=scores.value_cost.get)[:2])
    assert allocated.base_bits == (3, 2) == scores.base_bits and rotations.base_bits == (2, 2)
    assert scores.to_dict()["base_bits"] == {"key": 3, "value": 2}
    # the K4 gain is measured against K3: one layer's 4-bit keys measured again at the k3v2 widths
    layer = top[0]
    probe = RotationSet(
        16, rotations.key, rotations.value, value_clip=rotations.value_clip, key_bits={layer: 4}, base_bits=(3, 2)
    )
    caches = {
        "base": OscarCache(model, SMALL_K3V2, rotations=rotations),
        "k4": OscarCache(model, SMALL_K3V2, rotations=probe, allow_bits_change=True),
    }
    stats, _ = position_stats_of_caches(model, torch.cat([b[0] for b in batches]), caches, 48, 2, progress=False)
    gain = float(stats["base"][1, 12:].mean() - stats["k4"][1, 12:].mean())
    assert gain == pytest.approx(scores.key_gain[4][layer], rel=1e-6, abs=1e-9)
    cache = OscarCache(model, SMALL_K3V2, rotations=allocated)  # within oscar-k3v2's budget: no override needed
    assert sum(layer.config.key.bits + layer.config.value.bits for layer in cache.layers) == 4 * 5
    assert {i for i, layer in enumerate(cache.layers) if layer.config.key.bits == 4} == set(top)
    assert {i for i, layer in enumerate(cache.layers) if layer.config.value.bits == 1} == set(scores.value_layers)
    # an oscar-int2 cache keeps its 2-bit widths with these rotations
    int2 = OscarCache(model, SMALL, rotations=allocated)
    assert [(layer.config.key.bits, layer.config.value.bits) for layer in int2.layers] == [(2, 2)] * 4


@pytest.mark.parametrize("name, per_key", [("smollm2-135m-instruct", 2), ("smollm2-135m-instruct-k3v2", 1)])
def test_a_bundled_sets_recorded_scores_give_its_widths_and_other_budgets(name, per_key):
    """The scores do not depend on N: re-spent at the set's own N they give its stored widths; at other N they
    keep the history's bits, with the cheapest value layers at 1 bit."""
    from oscar_hf.rotations.files import load_ours, load_rotation_config
    from oscar_hf.rotations.resolve import bundled_rotations_dir

    directory = bundled_rotations_dir(name)
    record = load_rotation_config(directory)["bit_allocation"]
    recorded = BitAllocation.from_dict(record)
    assert recorded.to_dict() == record
    rotations = load_ours(directory)
    own = len(recorded.value_layers) // per_key
    again = recorded.respend(own).widths_of(rotations)
    assert (again.key_bits, again.value_bits, again.base_bits) == (
        rotations.key_bits,
        rotations.value_bits,
        rotations.base_bits,
    )
    key, value = recorded.base_bits
    for layers in (1, own - 2, own + 3):
        spent = recorded.respend(layers)
        assert spent.allocated_kl is None and spent.key_gain == recorded.key_gain
        assert sum(bits - key for bits in spent.key_bits.values()) == (4 - key) * layers
        cheapest = sorted(recorded.value_cost, key=recorded.value_cost.get)[: per_key * layers]
        assert spent.value_layers == sorted(cheapest)
        cache_bits = sum(spent.key_bits.get(i, key) + (1 if i in cheapest else value) for i in recorded.value_cost)
        assert cache_bits == (key + value) * len(recorded.value_cost)  # the history keeps its size
    with pytest.raises(ValueError, match="1 to"):
        recorded.respend(len(recorded.value_cost) // per_key + 1)


def test_the_allocation_validates_its_inputs():
    model = tiny_model("llama")
    rotations = RotationSet.hadamard(16, [0, 1])
    with pytest.raises(ValueError, match="1 to 1 layers"):
        allocate_bits(model, _rows(1, 40), rotations, 2, SMALL, progress=False)
    with pytest.raises(ValueError, match="longer than sink"):
        allocate_bits(model, _rows(1, 12), rotations, 1, SMALL, progress=False)
    with pytest.raises(ValueError, match="2-bit widths"):
        allocate_bits(model, _rows(1, 40), rotations, 1, METHODS["oscar-k4v2"], progress=False)
    with pytest.raises(ValueError, match="1 to 2 layers"):  # one V1 layer per K4 layer against K3 V2
        allocate_bits(model, _rows(1, 40), rotations, 3, SMALL_K3V2, progress=False)
    with pytest.raises(ValueError, match="no key width above"):  # 3-bit keys are no step up from K3
        allocate_bits(model, _rows(1, 40), rotations, 1, SMALL_K3V2, key_widths=(3,), progress=False)
    for widths in ((5,), (2, 3)):
        with pytest.raises(ValueError, match="allocate_key_bits takes 3 and/or 4"):
            Recipe(allocate_bits=1, allocate_key_bits=widths)
    with pytest.raises(ValueError, match="allocate_key_bits takes 3 and/or 4"):
        Recipe(allocate_bits=1, allocate_key_bits=(3,), allocate_for="oscar-k3v2")
    k3v3 = SMALL.with_overrides(key=TensorQuantConfig(3), value=TensorQuantConfig(3))
    for base in (METHODS["oscar-int2-paper"], k3v3):
        with pytest.raises(ValueError, match="2-bit widths"):  # no per-layer widths; K3 V3: +1 bit against -2
            allocate_bits(model, _rows(1, 40), rotations, 1, base, progress=False)


@pytest.mark.parametrize("method, value_layers", [("oscar-int2", 2), ("oscar-k3v2", 1)])
def test_calibrate_command_allocates_bits(tmp_path, capsys, method, value_layers):
    """``oscar-hf calibrate --clip-search --allocate-bits 1 --allocate-for METHOD`` on a saved tiny model: widths
    and the method's widths they trade against in the rotation file."""
    from oscar_hf.rotations.files import load_rotation_config
    from oscar_hf.rotations.hub import load_rotations

    model_dir, data = saved_tiny_model(tmp_path)
    out = tmp_path / "rotations"
    run_calibrate(
        model_dir, data, 800, 400, out, "--clip-search", "--allocate-bits", "1", "--allocate-for", method, "--json"
    )
    summary = json.loads(capsys.readouterr().out)
    allocation = summary["bit_allocation"]
    base = METHODS[method]
    key_bits = {int(layer): bits for layer, bits in allocation["key_bits"].items()}
    assert (
        allocation["method"] == method and sum(bits - base.key.bits for bits in key_bits.values()) == 4 - base.key.bits
    )
    assert len(allocation["value_1bit_layers"]) == value_layers
    assert {row["layer"]: row["key_bits"] for row in summary["per_layer"]} == {
        layer: key_bits.get(layer, base.key.bits) for layer in (0, 1)
    }
    rotations = load_rotations(out)
    assert rotations.key_bits == key_bits and rotations.value_bits == dict.fromkeys(allocation["value_1bit_layers"], 1)
    assert rotations.base_bits == (base.key.bits, base.value.bits)
    assert len(rotations.key_clip) == 2
    stored = load_rotation_config(out)
    assert (
        stored["base_bits"] == stored["bit_allocation"]["base_bits"] == {"key": base.key.bits, "value": base.value.bits}
    )
    widths = {str(bits) for bits in range(base.key.bits + 1, 5)}  # the default widths 3 and 4, above the base's
    assert set(stored["bit_allocation"]["key_gain"]) == widths
    assert all(set(gain) == {"0", "1"} for gain in stored["bit_allocation"]["key_gain"].values())
    assert stored["bit_allocation"]["baseline_kl"] == allocation["baseline_kl"]


def test_calibrate_command_allocates_widths_on_a_saved_set(tmp_path, capsys):
    """``--from-rotations DIR --allocate-bits 1 --allocate-for oscar-k3v2``: the saved set's rotations and
    clip ratios unchanged, widths allocated against K3 V2, the recipe and origin recorded."""
    from oscar_hf.rotations.files import load_rotation_config, save_rotations
    from oscar_hf.rotations.hub import load_rotations

    model_dir, data = saved_tiny_model(tmp_path)
    saved = RotationSet.hadamard(16, [0, 1])
    saved = RotationSet(
        16,
        saved.key,
        saved.value,
        key_clip={0: 0.84, 1: 0.9},
        value_clip={0: 0.88, 1: 0.92},
        key_bits={0: 4},
        value_bits={1: 1, 0: 1},
    )  # a 2-bit allocation, dropped
    save_rotations(saved, tmp_path / "saved", {"clip": "per-layer (clip search)", "command": "oscar-hf calibrate ..."})
    out = tmp_path / "k3v2"
    options = ["--from-rotations", str(tmp_path / "saved"), "--allocate-bits", "1", "--allocate-for", "oscar-k3v2"]
    run_calibrate(model_dir, data, 800, 400, out, *options)
    printed = capsys.readouterr().out
    assert "| widths" in printed and "C_Q" not in printed  # no covariances were collected
    allocated = load_rotations(out)
    assert allocated.base_bits == (3, 2) and len(allocated.key_bits) == 1 and len(allocated.value_bits) == 1
    for layer in (0, 1):
        assert torch.equal(allocated.key[layer], saved.key[layer]) and torch.equal(
            allocated.value[layer], saved.value[layer]
        )
    # key feedback (on by default) chooses the key clip of the saved set's 2-bit key layer again under its factors
    assert allocated.key_clip[0] == saved.key_clip[0] and allocated.key_clip[1] in CLIP_GRID
    assert allocated.value_clip == saved.value_clip and sorted(allocated.key_feedback) == [0, 1]
    stored = load_rotation_config(out)
    assert (
        stored["clip"] == "per-layer (clip search)" and stored["rotations_from"]["command"] == "oscar-hf calibrate ..."
    )
    assert set(stored["rotations_from"]["files"]) == {"config.json", "rotations.safetensors"}
    assert "--from-rotations" in stored["command"]
    from oscar_hf.calibration.record import existing_set

    _, again = existing_set(str(out))  # a set made from this one keeps the rotations' origin and lists the step
    assert again["rotations_from"]["command"] == "oscar-hf calibrate ..."
    assert again["rotations_from"]["then"] == [stored["command"]]


def test_calibrate_command_refuses_allocations_it_cannot_make(tmp_path):
    from oscar_hf.cli.main import main

    data = tmp_path / "text.txt"
    data.write_text("Some calibration text.")
    common = ["calibrate", "--data", str(data), "--out", str(tmp_path / "rotations")]
    with pytest.raises(SystemExit, match="drop --no-clip-search"):
        main([*common, "--no-clip-search", "--allocate-bits", "1"])
    with pytest.raises(SystemExit, match="add --allocate-bits N"):
        main([*common, "--allocate-for", "oscar-k3v2"])
    with pytest.raises(SystemExit, match="'oscar-k4v2' \\(K4 V2\\)"):
        main([*common, "--allocate-bits", "1", "--allocate-for", "oscar-k4v2"])
    with pytest.raises(SystemExit, match="add --allocate-bits N or --key-feedback"):
        main([*common, "--from-rotations", str(tmp_path), "--no-key-feedback"])
    with pytest.raises(SystemExit, match="drop refine, per_head and center_keys \\(--refine"):
        main([*common, "--from-rotations", str(tmp_path), "--allocate-bits", "1", "--refine"])
    with pytest.raises(SystemExit, match="--from-rotations: .* holds no config.json"):
        main([*common, "--from-rotations", str(tmp_path), "--allocate-bits", "1"])


def test_the_key_widths_spend_the_budget_where_the_summed_gain_is_largest():
    # two 3-bit layers (0.5 + 0.4) beat one 4-bit layer (0.8) for the bits of one 4-bit layer over K2
    gain = {3: {0: 0.5, 1: 0.4, 2: 0.1}, 4: {0: 0.8, 1: 0.6, 2: 0.2}}
    assert widest_gain(gain, 2, 2) == {0: 3, 1: 3}
    gain[4][0] = 1.0
    assert widest_gain(gain, 2, 2) == {0: 4}
    assert widest_gain(gain, 3, 2) == {0: 4, 1: 3}  # an odd budget: one of each
    assert widest_gain(gain, 6, 2) == {0: 4, 1: 4, 2: 4}  # every layer at 4 bits
    assert widest_gain({4: {0: -0.1, 1: 0.3}}, 1, 3) == {1: 4}  # K3 V2: one width, the top layer
    with pytest.raises(ValueError, match="spends exactly 7 bits"):
        widest_gain(gain, 7, 2)
