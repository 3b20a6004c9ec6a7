"""Plain ``model.generate`` replays whole decode steps: a cache made from the model holds a StaticDecoder,
and the model's forwards with that cache go through it.

On CPU the replayed steps run without a CUDA graph (``decode_graphs="step"``), through the torch
references; the GPU test in tests/test_static.py captures them.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.masking_utils import sdpa_mask

from oscar_hf import OscarCache, StaticDecoder
from oscar_hf.core.attention import oscar_mask
from oscar_hf.core.frozen_decoding import StaticDecoding
from oscar_hf.core.step_reuse import release_captured_steps
from tests.conftest import forward, generate, tiny_model
from tests.test_absorption import random_rotations
from tests.test_cache_contract import left_pad, prompts
from tests.test_per_head_rotations import per_head

SMALL = dict(sink=4, recent=8, block=4)


@pytest.fixture
def decoder_steps(monkeypatch):
    """Counts the one-token forwards a StaticDecoder ran (static steps) and its (re)freezes."""
    counts = {"steps": 0, "freezes": 0}
    step, freeze = StaticDecoder.step, StaticDecoding.__init__

    def counting_step(self, kwargs):
        logits = step(self, kwargs)
        counts["steps"] += logits is not None
        return logits

    def counting_freeze(self, *args, **kwargs):
        counts["freezes"] += 1
        return freeze(self, *args, **kwargs)

    monkeypatch.setattr(StaticDecoder, "step", counting_step)
    monkeypatch.setattr(StaticDecoding, "__init__", counting_freeze)
    return counts


@pytest.mark.parametrize("method", ["quarot-int2", "int4"])
def test_plain_generate_replays_steps_with_the_eager_cache_tokens(tiny, method, decoder_steps):
    ids, mask = left_pad(prompts([30, 26, 29]))
    want = generate(
        tiny, ids, OscarCache(tiny, method, decode_graphs=False, **SMALL), attention_mask=mask, max_new_tokens=40
    )
    cache = OscarCache(tiny, method, decode_graphs="step", **SMALL)
    got = generate(tiny, ids, cache, attention_mask=mask, max_new_tokens=40)
    assert torch.equal(got, want)
    # the prefill runs eagerly, every one-token step through the decoder the cache was made with
    assert decoder_steps["steps"] == 39 and isinstance(cache.step_decoder, StaticDecoder)
    # a second call continues from the cache: its longer chunk thaws it, its one-token steps replay again
    more = generate(
        tiny, got, cache, attention_mask=torch.cat([mask, torch.ones_like(got[:, ids.shape[1] :])], 1), max_new_tokens=6
    )
    reference = OscarCache(tiny, method, decode_graphs=False, **SMALL)
    generate(tiny, ids, reference, attention_mask=mask, max_new_tokens=40)
    assert torch.equal(
        more,
        generate(
            tiny,
            got,
            reference,
            max_new_tokens=6,
            attention_mask=torch.cat([mask, torch.ones_like(got[:, ids.shape[1] :])], 1),
        ),
    )


def test_a_growing_cache_freezes_again_when_full(tiny, monkeypatch, decoder_steps):
    import oscar_hf.core.freezing

    monkeypatch.setattr(oscar_hf.core.freezing, "MAX_SLACK_ROWS", 8)  # grow every 8 rows instead of every 4,096
    ids = prompts([30])[0][None]  # 64 history rows allocated by the prompt, then 8 more at a time
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", decode_graphs=False, **SMALL), max_new_tokens=120)
    cache = OscarCache(tiny, "quarot-int2", decode_graphs="step", **SMALL)
    assert torch.equal(generate(tiny, ids, cache, max_new_tokens=120), want)
    assert decoder_steps["freezes"] >= 3 and decoder_steps["steps"] == 119


def test_sampling_and_logits_processors_see_every_step(tiny):
    class Count(LogitsProcessor):
        calls = 0

        def __call__(self, input_ids, scores):
            Count.calls += 1
            return scores

    ids = prompts([24])[0][None]
    options = dict(do_sample=True, top_k=20, temperature=0.8, max_new_tokens=30)
    torch.manual_seed(7)
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", decode_graphs=False, **SMALL), **options)
    torch.manual_seed(7)
    got = generate(
        tiny,
        ids,
        OscarCache(tiny, "quarot-int2", decode_graphs="step", **SMALL),
        logits_processor=LogitsProcessorList([Count()]),
        **options,
    )
    assert torch.equal(got, want) and Count.calls == 30


def test_other_caches_and_models_are_not_routed(tiny):
    """Routing is per cache: the same model with a DynamicCache or a fresh OscarCache runs as before."""
    ids = prompts([24])[0][None]
    generate(tiny, ids, OscarCache(tiny, "quarot-int2", decode_graphs="step", **SMALL), max_new_tokens=8)
    assert getattr(tiny.forward, "routes_decode_steps", False)
    sdpa = tiny_model("llama" if tiny.config.model_type == "llama" else "qwen3", attn="sdpa")
    assert torch.equal(
        generate(tiny, ids, DynamicCache(config=tiny.config), max_new_tokens=8),
        generate(sdpa, ids, DynamicCache(config=sdpa.config), max_new_tokens=8),
    )
    fresh = OscarCache(tiny, "quarot-int2", decode_graphs=False, **SMALL)
    assert torch.equal(
        generate(tiny, ids, fresh, max_new_tokens=8),
        generate(tiny, ids, OscarCache(tiny, "quarot-int2", decode_graphs=False, **SMALL), max_new_tokens=8),
    )
    assert fresh.step_decoder is None


def test_a_cache_made_from_a_config_freezes_per_layer(tiny):
    """Without the model the cache cannot replay whole steps: its layers' attention calls are frozen."""
    ids = prompts([24])[0][None]
    cache = OscarCache(tiny.config, "quarot-int2", decode_graphs=True, **SMALL)
    generate(tiny, ids, cache, max_new_tokens=8)
    assert cache.step_decoder is None and cache.static is not None


def test_a_single_step_forward_goes_through_the_decoder(tiny, decoder_steps):
    """Not only generate: ``model(ids, cache=...)`` one token at a time replays too (the benchmarks do this)."""
    ids = prompts([24])[0][None]
    cache = OscarCache(tiny, "quarot-int2", decode_graphs="step", **SMALL)
    reference = OscarCache(tiny, "quarot-int2", decode_graphs=False, **SMALL)
    for each in (cache, reference):
        forward(tiny, ids, each)
    for token in range(3, 9):
        step = torch.tensor([[token]])
        torch.testing.assert_close(forward(tiny, step, cache).logits, forward(tiny, step, reference).logits)
    assert decoder_steps["steps"] == 6


def test_one_token_steps_without_padding_build_no_mask(tiny, monkeypatch):
    """A decode step's mask would grow by a key every step (compiled layers would recompile for each
    length): without padding none is built; with padding the mask still reaches attention."""
    masks = []
    forward = type(tiny.model.layers[0]).forward

    def recording(self, *args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny.model.layers[0]), "forward", recording)
    ids, mask = left_pad(prompts([30, 26]))
    generate(tiny, ids[:1, 4:], OscarCache(tiny, "quarot-int2", **SMALL), max_new_tokens=3)
    calls = 3 * len(tiny.model.layers)  # the prefill and two one-token steps through every layer
    assert masks == [None] * calls
    masks.clear()
    generate(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), attention_mask=mask, max_new_tokens=3)
    assert len(masks) == calls and all(m is not None for m in masks)
    # also where transformers would build one anyway (it may not skip the causal mask, e.g. while tracing)
    step = dict(batch_size=1, q_length=1, kv_length=40, q_offset=39, allow_is_causal_skip=False)
    assert sdpa_mask(**step) is not None and oscar_mask(**step) is None
    assert oscar_mask(**{**step, "q_length": 2}) is not None


def rotated_caches(model, seeds=(1, 2)):
    """Makers of whole-step caches of the same shapes with different rotations (so that a step read with
    another cache's rotations shows in the tokens), and the eager reference of each."""
    layers = list(range(model.config.num_hidden_layers))
    sets = [random_rotations(layers, seed=seed) for seed in seeds]

    def make(which: int, decode_graphs="step") -> OscarCache:
        return OscarCache(model, "oscar-int2", rotations=sets[which], decode_graphs=decode_graphs, **SMALL)

    return make


def test_a_fresh_cache_decodes_from_the_step_a_gone_cache_left(tiny):
    """lm-eval and pipelines make a cache per call: the next cache of the same shapes moves its rows and
    rotations into the step (and so the graph) the last one left with the model, and decodes its own tokens."""
    release_captured_steps(tiny)
    make = rotated_caches(tiny)
    first, second = prompts([30, 30], seed=3)
    cache = make(0)
    generate(tiny, first[None], cache, max_new_tokens=20)
    step = cache.step_decoder.current
    storage = [tensor.data_ptr() for tensor in cache.layers[0].frame()[0]]
    del cache  # nothing but its owner holds a cache: its step is left with the model at once
    want = generate(tiny, second[None], make(1, decode_graphs=False), max_new_tokens=20)
    cache = make(1)
    assert torch.equal(generate(tiny, second[None], cache, max_new_tokens=20), want)
    assert cache.step_decoder.current is step
    assert [tensor.data_ptr() for tensor in cache.layers[0].frame()[0]] == storage


def test_a_step_is_kept_only_once_its_cache_is_gone_and_until_released(tiny):
    release_captured_steps(tiny)
    make = rotated_caches(tiny)
    first, second = prompts([30, 30], seed=3)
    alive = make(0)
    out = generate(tiny, first[None], alive, max_new_tokens=20)
    other = make(1)
    assert torch.equal(
        generate(tiny, second[None], other, max_new_tokens=20),
        generate(tiny, second[None], make(1, decode_graphs=False), max_new_tokens=20),
    )
    assert other.step_decoder.current is not alive.step_decoder.current
    reference = make(0, decode_graphs=False)
    generate(tiny, first[None], reference, max_new_tokens=20)
    assert torch.equal(generate(tiny, out, alive, max_new_tokens=6), generate(tiny, out, reference, max_new_tokens=6))
    steps = [weakref.ref(alive.step_decoder.current), weakref.ref(other.step_decoder.current)]
    del alive, other  # the last to go is kept, the other freed
    assert idle_steps()[tiny] in [step() for step in steps]
    release_captured_steps(tiny)
    assert tiny not in idle_steps() and all(step() is None for step in steps)


def test_a_cache_frozen_again_decodes_from_its_own_step(tiny):
    make = rotated_caches(tiny)
    ids = prompts([30], seed=3)[0][None]
    cache, reference = make(0), make(0, decode_graphs=False)
    out = generate(tiny, ids, cache, max_new_tokens=20)
    generate(tiny, ids, reference, max_new_tokens=20)
    step = cache.step_decoder.current
    cache.crop(-1)  # thaws it; the next step freezes it again at the same shapes
    reference.crop(-1)
    assert torch.equal(generate(tiny, out, cache, max_new_tokens=6), generate(tiny, out, reference, max_new_tokens=6))
    assert cache.step_decoder.current is step


def idle_steps() -> dict:
    from oscar_hf.core import step_reuse

    return dict(step_reuse._idle)


@pytest.mark.parametrize("method", ["naive-int2", "oscar-int2"])
def test_a_frozen_step_reads_only_rotations_made_when_freezing(tiny, method, monkeypatch):
    """Rotations a step made for itself would, inside a capture, live in the graph's memory and be recomputed
    from the layer's masters at every replay: a cache that took the step over would read freed masters."""
    rotations = per_head() if method == "oscar-int2" else None  # per KV head: prefill expands them per query head
    cache = OscarCache(tiny, method, rotations=rotations, decode_graphs="step", **SMALL)
    made_in_steps, run = [], StaticDecoder._run

    def watched(self):
        before = [set(layer.rotation_copies()) for layer in cache.layers]
        logits = run(self)
        made_in_steps.extend(set(layer.rotation_copies()) - seen for layer, seen in zip(cache.layers, before))
        return logits

    monkeypatch.setattr(StaticDecoder, "_run", watched)  # what a CUDA graph captures
    generate(tiny, prompts([30], seed=3)[0][None], cache, max_new_tokens=8)
    assert cache.static is not None and made_in_steps and not any(made_in_steps)
