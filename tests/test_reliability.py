"""Faults and bad input: a step reaches every layer or the cache refuses further use, non-finite values
propagate, construction refuses what the cache cannot honour, and assisted decoding crops what it asks."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import DynamicCache

import oscar_hf.core.layer_attention
from oscar_hf import METHODS, CacheBrokenError, OscarCache, RotationSet, TensorQuantConfig
from oscar_hf.core.frozen_decoding import ReplayedCall
from tests.conftest import forward, generate, tiny_model

SMALL = dict(sink=4, recent=8, block=2)


def tokens(length: int, batch: int = 1, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def lengths(cache: OscarCache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


def poison_keys(model, layer_idx: int) -> None:
    """NaN keys from layer ``layer_idx`` on (its k_proj bias would do; the weights are simpler)."""
    with torch.no_grad():
        model.model.layers[layer_idx].self_attn.k_proj.weight[0, 0] = float("nan")


def test_a_step_that_fails_in_a_later_layer_breaks_the_cache_until_reset():
    model = tiny_model("llama")
    cache = OscarCache(model, "quarot-int2", check_finite=True, **SMALL)
    prompt = tokens(20)
    forward(model, prompt, cache)
    poison_keys(model, 1)
    with pytest.raises(ValueError, match="non-finite"):
        forward(model, tokens(1, seed=1), cache)
    for use in (
        lambda: forward(model, tokens(1, seed=2), cache),
        cache.get_seq_length,
        cache.memory_report,
        lambda: cache.crop(-1),
        lambda: cache.batch_repeat_interleave(2),
    ):
        with pytest.raises(CacheBrokenError, match=r"layer 1 raised ValueError .* 1 of 2 quantized layers.*reset\(\)"):
            use()
    model = tiny_model("llama")
    cache.reset()
    fresh = OscarCache(model, "quarot-int2", check_finite=True, **SMALL)
    torch.testing.assert_close(forward(model, prompt, cache).logits, forward(model, prompt, fresh).logits)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
# eager and frozen on this device; on a GPU also the frozen layout with per-layer CUDA graphs (the default there)
PATHS = [pytest.param(False, id="eager"), pytest.param(True, id="frozen"), pytest.param(None, id="graphs", marks=CUDA)]


def device_model(**config):
    """The tiny Llama on the GPU where there is one, at a head_dim the decode kernel takes (so that the
    frozen layout is captured in CUDA graphs), else on the CPU."""
    if not torch.cuda.is_available():
        return tiny_model("llama", **config)
    return tiny_model("llama", head_dim=DEVICE_HEAD_DIM, **config).to("cuda")


DEVICE_HEAD_DIM = 64 if torch.cuda.is_available() else 16


def fail_in_layer_1(monkeypatch, cache: OscarCache) -> None:
    """A simulated out-of-memory error in layer 1's decode attention, after layer 0 stored the step: in
    the kernel call or, under per-layer graphs (a frozen cache on CUDA), where its captured call replays."""
    error = torch.OutOfMemoryError("CUDA out of memory (simulated)")
    if cache.step_decoder is not None and cache.step_decoder.graph is not None:  # whole steps replay: fail one

        def replay(graph):
            raise error

        monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)
        return
    if cache.static is not None and cache.static.replayed is not None:  # a replay runs no Python: fail it
        real_call = ReplayedCall.__call__

        def replay(call, *inputs):
            if call.fn.args[:1] == (cache.layers[1],):
                raise error
            return real_call(call, *inputs)

        monkeypatch.setattr(ReplayedCall, "__call__", replay)
        return
    module = oscar_hf.core.layer_attention  # eager and frozen layers attend through it
    real, calls = module.decode_attention, []

    def kernel(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "decode_attention", kernel)


@pytest.mark.parametrize("frozen", PATHS)
def test_a_failure_inside_attention_breaks_the_cache(monkeypatch, frozen):
    """An error in layer 1's attention after layer 0 stored the step, on the eager path and the frozen
    layout; on a GPU, an error in the replay of the whole step that plain generate decodes with."""
    model = device_model()
    cache = OscarCache(model, "quarot-int2", decode_graphs=frozen, **SMALL)
    forward(model, tokens(20, device=model.device), cache)
    for seed in (4, 5, 6):  # freezes the cache when frozen; graphs are captured at the second step
        forward(model, tokens(1, seed=seed, device=model.device), cache)
    assert (cache.static is not None) == (frozen is not False)
    fail_in_layer_1(monkeypatch, cache)
    with pytest.raises(torch.OutOfMemoryError):
        forward(model, tokens(1, seed=1, device=model.device), cache)
    # Layer 1 had reserved its window row for the step and never computed it: nothing may use that.
    broken = "a replayed decode step raised" if frozen is None else r"layer 1 raised .* 1 of 2 quantized layers"
    with pytest.raises(CacheBrokenError, match=broken):
        forward(model, tokens(1, seed=2, device=model.device), cache)


@CUDA
def test_a_shape_the_decode_kernel_does_not_take_decodes_eagerly_on_a_gpu():
    """head_dim 16 runs the torch reference, which cannot be captured in a CUDA graph: no freezing."""
    model = tiny_model("llama").to("cuda")
    cache, eager = (
        OscarCache(model, "quarot-int2", **SMALL),
        OscarCache(model, "quarot-int2", decode_graphs=False, **SMALL),
    )
    prompt = tokens(20, device="cuda")
    torch.testing.assert_close(
        generate(model, prompt, cache, max_new_tokens=4), generate(model, prompt, eager, max_new_tokens=4)
    )
    assert cache.static is None


@pytest.mark.parametrize("mistake", ["batch", "dtype", "head_dim"])
def test_a_step_the_cache_cannot_store_is_refused_before_any_layer_stores_it(mistake):
    model = tiny_model("llama")
    cache = OscarCache(model, "quarot-int2", **SMALL)
    reference = OscarCache(model, "quarot-int2", **SMALL)
    prompt = tokens(20)
    forward(model, prompt, cache)
    forward(model, prompt, reference)
    keys = torch.zeros(1, 2, 1, 16)
    bad = {"batch": torch.zeros(2, 2, 1, 16), "dtype": keys.half(), "head_dim": torch.zeros(1, 2, 1, 8)}[mistake]
    with pytest.raises(ValueError, match={"batch": "batch size", "dtype": "dtype", "head_dim": "head_dim"}[mistake]):
        cache.update(bad, bad.clone(), 0)
    assert lengths(cache) == [20, 20] and cache.broken is None
    step = tokens(1, seed=3)
    torch.testing.assert_close(forward(model, step, cache).logits, forward(model, step, reference).logits)


@pytest.mark.parametrize("frozen", PATHS)
@pytest.mark.parametrize("method", ["quarot-int2", "int4", "oscar-k3v2"])
def test_a_non_finite_key_propagates_like_dynamic_cache(method, frozen):
    """With check_finite off, NaN keys give NaN logits at every later step (as DynamicCache with eager
    attention gives), never a plausible finite answer: masking only touches masked positions."""
    model = device_model()
    rotations = RotationSet.hadamard(DEVICE_HEAD_DIM, [0, 1]) if METHODS[method].rotation == "calibrated" else None
    cache = OscarCache(model, method, rotations=rotations, decode_graphs=frozen, **SMALL)
    forward(model, tokens(20, device=model.device), cache)
    poison_keys(model, 1)
    reference = device_model(attn="eager")
    poison_keys(reference, 1)
    assert (
        forward(reference, tokens(21, device=model.device), DynamicCache(config=model.config))
        .logits[:, -1]
        .isnan()
        .all()
    )
    for seed in (1, 2):  # the step with the NaN key, then one that only finds it in the cache
        assert forward(model, tokens(1, seed=seed, device=model.device), cache).logits.isnan().all()


def test_construction_refuses_settings_the_cache_cannot_honour():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="recent must be at least 1"):
        OscarCache(model, "quarot-int2", sink=4, recent=0)
    with pytest.raises(TypeError, match="block"):
        OscarCache(model, "quarot-int2", block=True)
    with pytest.raises(TypeError, match="recent"):
        OscarCache(model, "quarot-int2", recent=8.0)
    with pytest.raises(TypeError, match="bits"):
        TensorQuantConfig(2.0)
    with pytest.raises(TypeError, match="OscarCache.from_zoo"):
        OscarCache(model, "oscar-int2", rotations="some/dir")


def test_rotations_a_method_does_not_use_are_logged(caplog):
    model = tiny_model("llama")
    rotations = RotationSet.hadamard(16, [0, 1])
    with caplog.at_level(logging.WARNING, logger="oscar_hf"):
        OscarCache(model, "quarot-int2", rotations=rotations)
    assert "ignored" in caplog.text


@pytest.mark.parametrize(
    "other, difference",
    [
        (dict(num_hidden_layers=3), "full-attention layers"),
        (dict(num_hidden_layers=1), "full-attention layers"),
        (dict(head_dim=32), "head_dim"),
        (dict(num_key_value_heads=4), "KV heads"),
    ],
)
def test_a_cache_used_with_another_model_names_the_difference(other, difference):
    cache = OscarCache(tiny_model("llama"), "quarot-int2", **SMALL)
    with pytest.raises(ValueError, match=difference):
        forward(tiny_model("llama", **other), tokens(12), cache)


@pytest.mark.parametrize("other", [dict(num_hidden_layers=3), dict(num_key_value_heads=4)])
def test_a_refused_cache_leaves_nothing_behind_for_other_forwards(other):
    """Only the refused cache is broken: the model it was refused by runs as before without it (no cache,
    a default generate), and stays token-identical to SDPA."""
    cache = OscarCache(tiny_model("llama"), "quarot-int2", **SMALL)
    model, sdpa = tiny_model("llama", **other), tiny_model("llama", attn="sdpa", **other)
    with pytest.raises(ValueError):
        forward(model, tokens(12), cache)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(12), use_cache=False).logits, sdpa(tokens(12), use_cache=False).logits)
        torch.testing.assert_close(
            model.generate(tokens(12), max_new_tokens=4, do_sample=False),
            sdpa.generate(tokens(12), max_new_tokens=4, do_sample=False),
        )
    with pytest.raises(CacheBrokenError):
        forward(model, tokens(12), cache)


def test_a_forward_without_the_cache_after_one_that_bypassed_it():
    """A cache left with chunks no attention used (its model ran SDPA) does not hold up other forwards."""
    sdpa = tiny_model("llama", attn="sdpa")
    config = copy.deepcopy(sdpa.config)
    config._attn_implementation = "oscar"
    cache = OscarCache(config, "quarot-int2", **SMALL)
    forward(sdpa, tokens(12), cache)
    model = tiny_model("llama")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(12), use_cache=False).logits, sdpa(tokens(12), use_cache=False).logits)


def test_an_empty_cache_reports_no_tokens_rather_than_nan():
    report = OscarCache(tiny_model("llama"), "quarot-int2").memory_report()
    assert "nan" not in str(report).lower() and "no tokens" in str(report)


@pytest.mark.parametrize("method", ["none", "quarot-int2"])
@pytest.mark.parametrize("assistant", ["prompt_lookup", "draft_model"])
def test_assisted_decoding_with_more_candidates_than_the_window(method, assistant):
    """Candidates beyond the recent window are quantized by the verification step; rejected ones are
    cropped from the end of the history. With ``none`` the output is plain greedy's."""
    model = tiny_model("llama")
    prompt = torch.cat([tokens(16)] * 3, dim=1)  # repeats, so that prompt lookup proposes candidates
    extra = (
        {"prompt_lookup_num_tokens": 12}
        if assistant == "prompt_lookup"
        else {"assistant_model": tiny_model("llama", seed=1), "num_assistant_tokens": 12}
    )
    cache = OscarCache(model, method, sink=4, recent=3, block=2)
    got = generate(model, prompt, cache, max_new_tokens=30, **extra)
    assert got.shape[1] == prompt.shape[1] + 30
    assert lengths(cache) == [prompt.shape[1] + 29] * 2
    if method == "none":
        torch.testing.assert_close(got, generate(model, prompt, DynamicCache(config=model.config), max_new_tokens=30))


@pytest.mark.parametrize("method", ["none", "quarot-int2"])
def test_crop_takes_the_count_as_a_0d_tensor(method):
    """transformers 5.17's assisted decoding crops by a 0-d tensor: the layers keep integer lengths and
    the next step attends over exactly what a crop by the int leaves."""
    model = tiny_model("llama")
    caches = [OscarCache(model, method, sink=4, recent=3, block=2) for _ in range(2)]
    for cache, count in zip(caches, (torch.tensor(-5), -5)):
        forward(model, tokens(30), cache)
        cache.crop(count)
    assert lengths(caches[0]) == [25, 25] and all(type(n) is int for n in lengths(caches[0]))
    step = tokens(13, seed=2)
    torch.testing.assert_close(
        forward(model, step, caches[0]).logits, forward(model, step, caches[1]).logits, rtol=0, atol=0
    )
    with pytest.raises(TypeError):
        caches[0].crop(-2.0)


@pytest.mark.parametrize("method", ["none", "quarot-int2"])
def test_a_positive_crop_means_what_the_installed_transformers_makes_of_it(method):
    """Before 5.18 a positive count is the length to keep; from 5.18 transformers' own layers refuse it."""
    model = tiny_model("llama")
    cache, dynamic = OscarCache(model, method, **SMALL), DynamicCache(config=model.config)
    for each in (cache, dynamic):
        forward(model, tokens(30), each)
    try:
        dynamic.crop(25)
    except ValueError:
        with pytest.raises(ValueError, match="negative count"):
            cache.crop(25)
        assert lengths(cache) == [30, 30]
    else:
        cache.crop(25)
        assert lengths(cache) == [dynamic.get_seq_length()] * 2 == [25, 25]


def test_a_model_whose_attention_bypasses_the_cache_is_named():
    """A cache built from a config that runs the oscar attention, used by a model that runs SDPA: the
    chunks it stashed are never attended to, and the next use says why."""
    model = tiny_model("llama", attn="sdpa")
    config = copy.deepcopy(model.config)
    config._attn_implementation = "oscar"
    cache = OscarCache(config, "quarot-int2", **SMALL)
    forward(model, tokens(12), cache)
    with pytest.raises(CacheBrokenError, match="attn_implementation='oscar'"):
        forward(model, tokens(1, seed=1), cache)
