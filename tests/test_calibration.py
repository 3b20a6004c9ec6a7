"""Calibration statistics and rotation artifacts, on tiny random models (no weights, no hub)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AttentionInterface,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oscar_hf.calibration import covariances as calibration
from oscar_hf.calibration.covariances import CALIBRATION_ATTENTION, collect_covariances, fit_rotations
from oscar_hf.rotations.files import CONFIG_FILE, TENSORS_FILE, load_rotation_config, save_rotations
from oscar_hf.rotations.hub import load_rotations
from oscar_hf.rotations.resolve import DEFAULT_PAPER_ROTATIONS, DEFAULT_ROTATIONS, bundled_rotations_dir
from oscar_hf.rotations.rotation_set import RotationSet, check_orthogonal, rotation_from_covariance

VOCAB = 128
HEAD_DIM = 16
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
)
GEMMA_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def tiny_llama(attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, **SMALL)
    return LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).eval()


def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(1)
    config = Qwen3Config(num_hidden_layers=2, **SMALL)
    return Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").eval()


def tiny_gemma3() -> Gemma3ForCausalLM:
    torch.manual_seed(2)
    config = Gemma3TextConfig(num_hidden_layers=4, layer_types=GEMMA_LAYER_TYPES, sliding_window=4, **SMALL)
    return Gemma3ForCausalLM._from_config(config, attn_implementation="sdpa").eval()


MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3, "gemma3": tiny_gemma3}


def random_rows(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def capture_qkv(model, batches: list[torch.Tensor]) -> dict[int, list[tuple[torch.Tensor, ...]]]:
    """The exact (query, key, value) every layer hands to its attention function, per forward."""
    captured: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        captured.setdefault(module.layer_idx, []).append((query.clone(), key.clone(), value.clone()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("oscar_test_recording", record)
    AttentionMaskInterface.register("oscar_test_recording", sdpa_mask)
    model.set_attn_implementation("oscar_test_recording")
    try:
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch, use_cache=False)
    finally:
        model.set_attn_implementation("sdpa")
    return captured


def naive_targets(chunks: list[tuple[torch.Tensor, ...]], grouping: str = "contiguous") -> tuple[torch.Tensor, ...]:
    """C_Q and C_S written as the reference codes them: tokens-first [n, H, D] float64 dumps, one shot."""
    per_head_q, per_head_s, _ = naive_per_head_targets(chunks, grouping)
    c_q = per_head_q.mean(0)
    c_s = per_head_s.mean(0)
    return (c_q + c_q.T) / 2, (c_s + c_s.T) / 2


def naive_per_head_targets(
    chunks: list[tuple[torch.Tensor, ...]], grouping: str = "contiguous"
) -> tuple[torch.Tensor, ...]:
    """C_Q^(h), C_S^(h) and K_h^T K_h / n of each KV head, ``[H_kv, D, D]``, before pooling."""
    q = torch.cat([c[0].transpose(1, 2).reshape(-1, c[0].shape[1], c[0].shape[3]) for c in chunks]).double()
    k = torch.cat([c[1].transpose(1, 2).reshape(-1, c[1].shape[1], c[1].shape[3]) for c in chunks]).double()
    v = torch.cat([c[2].transpose(1, 2).reshape(-1, c[2].shape[1], c[2].shape[3]) for c in chunks]).double()
    n, query_heads, dim = q.shape
    kv_heads = k.shape[1]
    g = query_heads // kv_heads
    per_head_q, per_head_s = [], []
    for h in range(kv_heads):
        heads = list(range(h * g, (h + 1) * g)) if grouping == "contiguous" else list(range(h, query_heads, kv_heads))
        q_h = q[:, heads, :].reshape(-1, dim)
        c_q = q_h.T @ q_h / (n * g)
        per_head_q.append(c_q)
        w = torch.einsum("ti,ij,tj->t", k[:, h], c_q, k[:, h])
        w = w / max(w.sum().item(), 1e-12) * n
        scaled = v[:, h] * w.sqrt()[:, None]
        per_head_s.append(scaled.T @ scaled / n)
    key_grams = torch.einsum("thi,thj->hij", k, k) / n
    return torch.stack(per_head_q), torch.stack(per_head_s), key_grams


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_streaming_matches_naive(name: str) -> None:
    model = MODELS[name]()
    batches = [random_rows(2, 12, seed=0), random_rows(1, 20, seed=1)]
    covariances = collect_covariances(model, batches, progress=False)
    captured = capture_qkv(model, batches)
    assert covariances, "no layer was calibrated"
    for layer_id, layer in covariances.items():
        c_q, c_s = naive_targets(captured[layer_id])
        assert layer.query.dtype == layer.value.dtype == torch.float64
        assert layer.tokens == 2 * 12 + 20
        assert relative_error(layer.query, c_q) < 1e-10
        assert relative_error(layer.value, c_s) < 1e-10
        assert torch.equal(layer.query, layer.query.T) and torch.equal(layer.value, layer.value.T)
        keys = torch.cat([k.transpose(1, 2).reshape(-1, k.shape[1], k.shape[3]) for _, k, _ in captured[layer_id]])
        assert relative_error(layer.key_mean_heads, keys.double().mean(0)) < 1e-10  # [H_kv, D]


def test_gqa_grouping_is_contiguous() -> None:
    model = tiny_llama()
    batches = [random_rows(2, 16)]
    layer = collect_covariances(model, batches, progress=False)[0]
    chunks = capture_qkv(model, batches)[0]
    _, contiguous = naive_targets(chunks, "contiguous")
    _, interleaved = naive_targets(chunks, "interleaved")
    # C_Q pools all query heads, so only C_S (weighted by the group's C_Q^(h)) can tell the groupings apart.
    assert relative_error(contiguous, interleaved) > 1e-3
    assert relative_error(layer.value, contiguous) < 1e-10
    assert relative_error(layer.value, interleaved) > 1e-3


def test_batch_split_does_not_matter() -> None:
    model = tiny_llama()
    rows = random_rows(4, 10)
    splits = [[rows], [rows[:1], rows[1:3], rows[3:]], [row for row in rows]]
    results = [collect_covariances(model, split, progress=False) for split in splits]
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        for layer_id, layer in other.items():
            assert layer.tokens == results[0][layer_id].tokens == 40
            # Only the float32 forward of differently shaped batches may differ, not the float64 sums.
            assert relative_error(layer.query, results[0][layer_id].query) < 1e-5
            assert relative_error(layer.value, results[0][layer_id].value) < 1e-5


def test_calibrate_returns_orthogonal_rotations() -> None:
    model = tiny_llama()
    batches = [random_rows(2, 16)]
    rotations = fit_rotations(model, batches, progress=False)
    covariances = collect_covariances(model, batches, progress=False)
    assert rotations.head_dim == HEAD_DIM
    assert sorted(rotations.key) == sorted(rotations.value) == [0, 1]
    for layer_id in (0, 1):
        check_orthogonal(rotations.key[layer_id], "R_K", tolerance=1e-5)
        check_orthogonal(rotations.value[layer_id], "R_V", tolerance=1e-5)
        expected_key, expected_eigenvalues = rotation_from_covariance(covariances[layer_id].query)
        assert torch.allclose(rotations.key[layer_id], expected_key, atol=1e-5)
        assert torch.allclose(rotations.key_eigenvalues[layer_id], expected_eigenvalues)
        assert bool((rotations.value_eigenvalues[layer_id].diff() >= 0).all()), "eigenvalues must be ascending"


def test_per_head_targets_and_rotations() -> None:
    """Per KV head: C_Q^(h) of its own query group, C_S^(h) with its own weights, and R^(h) = U·H·P of each."""
    model = tiny_qwen3()
    batches = [random_rows(2, 12, seed=0), random_rows(1, 20, seed=1)]
    covariances = collect_covariances(model, batches, progress=False)
    captured = capture_qkv(model, batches)
    for layer_id, layer in covariances.items():
        c_q, c_s, key_grams = naive_per_head_targets(captured[layer_id])
        assert layer.query_heads.shape == (2, HEAD_DIM, HEAD_DIM)
        for actual, expected in ((layer.query_heads, c_q), (layer.value_heads, c_s), (layer.key_gram_heads, key_grams)):
            assert relative_error(actual, expected) < 1e-10
            assert torch.equal(actual, actual.mT)
        assert relative_error(layer.key_gram, key_grams.mean(0)) < 1e-10
        assert relative_error(c_q[0], c_q[1]) > 1e-2  # the heads differ, so per-head R differ from the pooled one
    rotations = fit_rotations(model, batches, progress=False, per_head=True)
    assert rotations.per_head and rotations.kv_heads == 2 and "one per KV head" in rotations.description
    shared = fit_rotations(model, batches, progress=False)
    for layer_id, layer in covariances.items():
        assert rotations.key[layer_id].shape == rotations.value[layer_id].shape == (2, HEAD_DIM, HEAD_DIM)
        assert rotations.key_eigenvalues[layer_id].shape == (2, HEAD_DIM)
        for head in range(2):
            expected_key, expected_eigenvalues = rotation_from_covariance(layer.query_heads[head])
            assert torch.equal(rotations.key[layer_id][head], expected_key)
            assert torch.equal(rotations.key_eigenvalues[layer_id][head], expected_eigenvalues)
            assert torch.equal(rotations.value[layer_id][head], rotation_from_covariance(layer.value_heads[head])[0])
        assert torch.equal(shared.key[layer_id], rotation_from_covariance(layer.query)[0])
    ktk = calibration.rotations_from_covariances(covariances, "ktk_vtv", "UH", per_head=True)
    for layer_id, layer in covariances.items():
        assert torch.equal(ktk.key[layer_id][1], rotation_from_covariance(layer.key_gram_heads[1], "UH")[0])


def test_only_full_attention_layers_are_calibrated() -> None:
    model = tiny_gemma3()
    covariances = collect_covariances(model, [random_rows(1, 16)], progress=False)
    assert sorted(covariances) == [1, 3]
    rotations = fit_rotations(model, [random_rows(1, 16)], progress=False)
    assert sorted(rotations.key) == sorted(rotations.value) == [1, 3]


def test_calibration_attention_keeps_the_forward_and_its_masks() -> None:
    # With sliding layers a missing mask registration would silently turn them into full causal attention.
    model = tiny_gemma3()
    batch = random_rows(1, 16)
    collect_covariances(model, [batch], progress=False)  # registers the implementation
    with torch.no_grad():
        expected = model(input_ids=batch, use_cache=False).logits
        model.set_attn_implementation(CALIBRATION_ATTENTION)
        actual = model(input_ids=batch, use_cache=False).logits
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_attention_implementation_is_restored() -> None:
    model = tiny_llama("eager")
    model.train()
    fit_rotations(model, [random_rows(1, 8)], progress=False)
    assert model.config._attn_implementation == "eager"
    assert model.training and calibration._active_recorder is None


def test_attention_implementation_is_restored_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama("eager")

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(model.model.layers[1].mlp, "forward", broken)
    with pytest.raises(RuntimeError, match="boom"):
        collect_covariances(model, [random_rows(1, 8)], progress=False)
    assert model.config._attn_implementation == "eager"
    assert not model.training and calibration._active_recorder is None


def test_rejects_bad_batches() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="at least one batch"):
        collect_covariances(model, [], progress=False)
    with pytest.raises(ValueError, match="LongTensor"):
        collect_covariances(model, [torch.zeros(1, 4)], progress=False)


def random_rotation_set(layer_ids: list[int], head_dim: int = HEAD_DIM) -> RotationSet:
    generator = torch.Generator().manual_seed(0)

    def orthogonal() -> torch.Tensor:
        return torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))[0].float()

    return RotationSet(
        head_dim,
        key={i: orthogonal() for i in layer_ids},
        value={i: orthogonal() for i in layer_ids},
        description="test rotations",
        key_eigenvalues={i: torch.rand(head_dim, generator=generator).sort().values for i in layer_ids},
        value_eigenvalues={i: torch.rand(head_dim, generator=generator).sort().values for i in layer_ids},
    )


def test_save_load_round_trip(tmp_path) -> None:
    rotations = random_rotation_set([1, 3])
    metadata = {"model_id": "tiny", "objective": "qqt_sst", "composition": "r_h_pbr", "tokens": 123}
    out = save_rotations(rotations, tmp_path / "rot", metadata)
    assert {p.name for p in out.iterdir()} == {TENSORS_FILE, CONFIG_FILE}
    loaded = load_rotations(out)
    assert loaded.head_dim == HEAD_DIM and loaded.description == "test rotations"
    for table in ("key", "value", "key_eigenvalues", "value_eigenvalues"):
        expected, actual = getattr(rotations, table), getattr(loaded, table)
        assert sorted(actual) == [1, 3]
        assert all(torch.equal(actual[i], expected[i]) for i in expected)
    config = load_rotation_config(out)
    assert config["format"] == "oscar-hf-rotations" and config["format_version"] == 1
    assert config["layer_ids"] == [1, 3] and config["head_dim"] == HEAD_DIM
    assert {k: config[k] for k in metadata} == metadata
    assert isinstance(config["library_version"], str)


def test_save_hadamard_set_with_shared_tensors(tmp_path) -> None:
    rotations = RotationSet.hadamard(HEAD_DIM, [0, 1, 2])
    loaded = load_rotations(save_rotations(rotations, tmp_path))
    assert torch.equal(loaded.key[2], rotations.key[0]) and loaded.key_eigenvalues == {}


def test_load_rejects_wrong_shape(tmp_path) -> None:
    out = save_rotations(random_rotation_set([0]), tmp_path)
    save_file({"layers.0.key_rotation": torch.eye(8), "layers.0.value_rotation": torch.eye(8)}, str(out / TENSORS_FILE))
    with pytest.raises(ValueError, match="shape"):
        load_rotations(out)


def test_load_rejects_bad_directories(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        load_rotations(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        load_rotations(tmp_path)
    out = save_rotations(random_rotation_set([0]), tmp_path / "rot")
    (out / TENSORS_FILE).unlink()
    with pytest.raises(FileNotFoundError):
        load_rotations(out)
    (out / CONFIG_FILE).write_text(json.dumps({"format": "something-else", "format_version": 1}))
    with pytest.raises(ValueError, match="format"):
        load_rotation_config(out)


def test_metadata_cannot_override_format_keys(tmp_path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        save_rotations(random_rotation_set([0]), tmp_path, {"head_dim": 3})


@pytest.mark.parametrize(
    "name, composition, tokens",
    [
        (DEFAULT_ROTATIONS, "per-layer r_h_pbr or h_pbr (clip search)", 81920),
        (DEFAULT_PAPER_ROTATIONS, "r_h_pbr", 20000),
        ("smollm2-135m-instruct-k3v2", "per-layer r_h_pbr or h_pbr (clip search)", 81920),
    ],
)
def test_bundled_default_rotations_load(name: str, composition: str, tokens: int) -> None:
    path = bundled_rotations_dir(name)
    assert path.parts[-4:] == ("oscar_hf", "assets", "rotations", name)
    rotations = load_rotations(path)  # also checks every rotation is orthogonal
    config = load_rotation_config(path)
    assert rotations.head_dim == 64 and sorted(rotations.key) == sorted(rotations.value) == list(range(30))
    assert config["objective"] == "qqt_sst" and config["composition"] == composition and config["tokens"] == tokens
    assert config["command"].startswith("oscar-hf calibrate") and "pg1342.txt" in config["command"]
    assert " /" not in config["command"]  # data by file name (and hash, below), no path of the machine that made it
