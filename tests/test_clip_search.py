"""Per-layer clip ratios and rotation variants: chosen by attention-output error, stored, and used by the cache."""

from __future__ import annotations

import json

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.calibration.clip_search import CLIP_GRID, search_layers
from oscar_hf.calibration.covariances import collect_covariances, rotations_from_covariances
from oscar_hf.config import METHODS
from tests.conftest import calibration_text, run_calibrate, saved_tiny_model, tiny_model

SMALL = METHODS["oscar-int2"].with_overrides(sink=4, recent=8, block=2)


@pytest.fixture(scope="module")
def searched():
    model = tiny_model("llama")
    torch.manual_seed(0)
    batches = [torch.randint(3, 256, (1, 64)) for _ in range(3)]
    covariances = collect_covariances(model, batches, progress=False)
    rotations, choices = search_layers(model, batches[:2], covariances, SMALL, max_queries=32, progress=False)
    return model, covariances, rotations, choices


def test_every_layer_gets_the_candidate_with_the_smallest_error(searched):
    _, _, rotations, choices = searched
    assert sorted(choices) == [0, 1]
    for layer_id, choice in choices.items():
        assert len(choice.key_errors) == len(choice.value_errors) == 2 * len(CLIP_GRID)
        assert min(choice.key_errors, key=choice.key_errors.get) == f"{choice.key_factors}@{choice.key_clip}"
        assert min(choice.value_errors, key=choice.value_errors.get) == f"{choice.value_factors}@{choice.value_clip}"
        assert all(0 < e < 1 for e in choice.key_errors.values())
        assert rotations.key_clip[layer_id] == choice.key_clip and rotations.value_clip[layer_id] == choice.value_clip


def test_the_chosen_variant_matrices_are_stored(searched):
    _, covariances, rotations, choices = searched
    for layer_id, choice in choices.items():
        expected = rotations_from_covariances(covariances, "qqt_sst", choice.key_factors)
        torch.testing.assert_close(rotations.key[layer_id], expected.key[layer_id])
        expected = rotations_from_covariances(covariances, "qqt_sst", choice.value_factors)
        torch.testing.assert_close(rotations.value[layer_id], expected.value[layer_id])


def test_the_cache_uses_per_layer_clip_ratios_where_the_method_clips(searched):
    model, _, rotations, choices = searched
    cache = OscarCache(model, "oscar-int2", rotations=rotations)
    for layer_id, choice in choices.items():
        assert cache.layers[layer_id].config.key.clip_ratio == choice.key_clip
        assert cache.layers[layer_id].config.value.clip_ratio == choice.value_clip
    fixed = OscarCache(model, "oscar-int2", rotations=rotations, layer_clip=False)
    assert fixed.layers[0].config.key.clip_ratio == 0.96
    k4v2 = OscarCache(model, "oscar-k4v2", rotations=rotations)
    assert k4v2.layers[0].config.key.clip_ratio == 0.0  # the method does not clip its 4-bit keys
    assert k4v2.layers[0].config.value.clip_ratio == choices[0].value_clip


def test_rows_too_short_for_the_window_are_refused():
    model = tiny_model("llama")
    batches = [torch.randint(3, 256, (1, 10))]
    covariances = collect_covariances(model, batches, progress=False)
    with pytest.raises(ValueError, match="too short for the clip search"):
        search_layers(model, batches, covariances, SMALL, progress=False)


@pytest.mark.slow
def test_calibrate_command_on_the_default_model(tmp_path, capsys):
    from oscar_hf.rotations.files import load_rotation_config
    from oscar_hf.rotations.hub import load_rotations

    out = tmp_path / "rotations"
    run_calibrate("default", calibration_text(tmp_path / "text.txt"), 1200, 600, out, "--json")  # clip search: default
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["layers"] == 30 and summary["tokens"] == 1200
    assert len(summary["per_layer"]) == 30 and "key" in summary["per_layer"][0]
    rotations = load_rotations(out)
    assert len(rotations.key_clip) == 30
    config = load_rotation_config(out)
    assert config["tokens"] == 1200 and config["model_signature"]["head_dim"] == 64
    assert len(config["calibration_data"]["files"]["text.txt"]) == 64  # sha256 of the data file


def test_per_head_search_picks_per_layer_variants_of_per_head_rotations(searched):
    model, covariances, _, _ = searched
    batches = [torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    rotations, choices = search_layers(
        model, batches, covariances, SMALL, max_queries=32, progress=False, per_head=True
    )
    assert rotations.kv_heads == 2
    for layer_id, choice in choices.items():
        key = rotations_from_covariances(covariances, "qqt_sst", choice.key_factors, per_head=True).key[layer_id]
        value = rotations_from_covariances(covariances, "qqt_sst", choice.value_factors, per_head=True).value[layer_id]
        assert torch.equal(rotations.key[layer_id], key) and torch.equal(rotations.value[layer_id], value)
        assert rotations.key_clip[layer_id] == choice.key_clip
    cache = OscarCache(model, "oscar-int2", rotations=rotations)
    assert cache.layers[0].key_rotation.shape == (2, 16, 16)


def test_calibrate_command_per_head(tmp_path, capsys):
    """``oscar-hf calibrate --per-head --clip-search`` on a saved tiny model with the default model's tokenizer."""
    from oscar_hf.rotations.files import load_rotation_config
    from oscar_hf.rotations.hub import load_rotations

    model_dir, data = saved_tiny_model(tmp_path)
    out = tmp_path / "rotations"
    run_calibrate(model_dir, data, 800, 400, out, "--per-head", "--clip-search", "--json")
    summary = json.loads(capsys.readouterr().out)
    assert summary["layers"] == 2 and "key" in summary["per_layer"][0]
    rotations = load_rotations(out)
    assert rotations.kv_heads == 2 and len(rotations.key_clip) == 2
    assert load_rotation_config(out)["source_grouping"] == "per_kv_head"


def test_the_calibrate_function_makes_what_the_command_makes(tmp_path, capsys):
    """``oscar_hf.calibrate`` with a Recipe is the command's calibration: the same rotations, clips and
    choices from the same data, and a config that records the recipe and the data by file name and hash."""
    import oscar_hf
    from oscar_hf.core.models import load_model
    from oscar_hf.rotations.files import load_rotation_config
    from oscar_hf.rotations.hub import load_rotations

    model_dir, data = saved_tiny_model(tmp_path)
    run_calibrate(model_dir, data, 800, 400, tmp_path / "command", "--json")
    capsys.readouterr()
    model, tokenizer = load_model(str(model_dir))
    result = oscar_hf.calibrate(model, tokenizer, [data], oscar_hf.Recipe(tokens=800, seq_len=400), progress=False)
    command, function = load_rotations(tmp_path / "command"), load_rotations(result.save(tmp_path / "function"))
    for layer_id in command.key:
        assert torch.equal(command.key[layer_id], function.key[layer_id])
        assert torch.equal(command.value[layer_id], function.value[layer_id])
    assert command.key_clip == function.key_clip and command.value_clip == function.value_clip
    config = load_rotation_config(tmp_path / "function")
    assert config["recipe"] == {**oscar_hf.Recipe().to_dict(), "tokens": 800, "seq_len": 400}
    assert list(config["calibration_data"]["files"]) == [data.name] and str(tmp_path) not in json.dumps(
        config["recipe"]
    )
    assert config["layer_choices"] == load_rotation_config(tmp_path / "command")["layer_choices"]


def test_a_recipe_refuses_what_cannot_be_made():
    import oscar_hf

    with pytest.raises(ValueError, match="chooses between U·H·P and H·P itself"):
        oscar_hf.Recipe(factors="H")
    with pytest.raises(ValueError, match="allocate_bits starts from the clip search"):
        oscar_hf.Recipe(clip_search=False, allocate_bits=2)
    with pytest.raises(ValueError, match="objective must be one of"):
        oscar_hf.Recipe(clip_search=False, objective="kv")
    assert oscar_hf.Recipe(clip_search=False, factors="H").to_dict()["factors"] == "H"
    with pytest.raises(ValueError, match="search_for must be one of"):
        oscar_hf.Recipe(search_for="quarot-int2")
    with pytest.raises(ValueError, match="search_for names the method"):
        oscar_hf.Recipe(clip_search=False, search_for="oscar-k3v2")


def test_the_clip_search_measures_under_the_recipes_method(monkeypatch):
    """``Recipe(search_for=...)`` (``--search-for``): the clip search quantizes as that method does."""
    from oscar_hf.calibration import recipe as recipe_module

    model = tiny_model("llama")
    batches = [torch.randint(3, 256, (1, 400), generator=torch.Generator().manual_seed(0))]
    covariances = collect_covariances(model, batches, progress=False)
    measured = []

    def recording(model, rows, covariances, config, **options):
        measured.append(config)
        return rotations_from_covariances(covariances, "qqt_sst", "UHP"), {}

    monkeypatch.setattr(recipe_module, "search_layers", recording)
    for method in ("oscar-int2", "oscar-k3v2"):
        recipe_module.fit(recipe_module.Recipe(search_for=method), model, batches, covariances, progress=False)
    assert measured == [METHODS["oscar-int2"], METHODS["oscar-k3v2"]]
