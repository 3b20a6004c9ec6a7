"""Static decoding (a frozen OscarCache) and ``oscar_hf.generate``: the same tokens as the eager cache.

On CPU the static steps run without a CUDA graph (``capture=False``), through the torch references;
tests/test_kernels.py runs them through the (interpreted or compiled) kernels, and the GPU test here
replays a captured graph.
"""

from __future__ import annotations

import functools
import logging
import shutil

import pytest
import torch

import oscar_hf
from oscar_hf import OscarCache
from oscar_hf.config import METHODS
from oscar_hf.core.compat import cache_keyword
from oscar_hf.core.frozen_decoding import StaticDecoding, graphs_unsupported
from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.step_reuse import release_captured_steps
from oscar_hf.core.storage import aligned_rows
from tests.conftest import TINY, forward, generate, tiny_model
from tests.test_absorption import random_rotations
from tests.test_cache_contract import left_pad, prompts
from tests.test_step_replay import idle_steps

SMALL = dict(sink=4, recent=8, block=4)
# oscar-k3v2's bit widths and clipping (3-bit K, 2-bit V) with Hadamard rotations: no calibration needed
K3V2 = pytest.param(METHODS["oscar-k3v2"].with_overrides(rotation="hadamard"), id="k3v2")
CUDA = torch.cuda.is_available()


def fast(model, input_ids, cache, capture=False, **kwargs):
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("max_new_tokens", 24)
    kwargs.setdefault("min_new_tokens", kwargs["max_new_tokens"])
    with torch.no_grad():
        return oscar_hf.generate(model, input_ids, capture=capture, **{cache_keyword(model): cache}, **kwargs)


@pytest.fixture
def static_steps(monkeypatch):
    """Counts the static steps (device-side advances) a generation runs."""
    counts = {"steps": 0}
    advance = StaticDecoding.advance

    def counting(self):
        counts["steps"] += 1
        return advance(self)

    monkeypatch.setattr(StaticDecoding, "advance", counting)
    return counts


@pytest.mark.parametrize("method", ["quarot-int2", "int4", "naive-int2", K3V2])
def test_static_greedy_is_token_identical_to_the_eager_cache(tiny, method, static_steps):
    ids, mask = left_pad(prompts([30, 26, 29]))  # pads stay in the sink: its mask is fixed when freezing
    want = generate(tiny, ids, OscarCache(tiny, method, **SMALL), attention_mask=mask, max_new_tokens=40)
    cache = OscarCache(tiny, method, **SMALL)
    got = fast(tiny, ids, cache, attention_mask=mask, max_new_tokens=40)
    assert torch.equal(got, want)
    assert static_steps["steps"] == 39  # every step after the prefill's
    assert cache.static is None and cache.get_seq_length() == got.shape[1] - 1  # thawed for reuse


def test_a_window_that_is_not_whole_blocks_never_wraps_a_demoted_block(tiny):
    ids = prompts([30])[0][None]  # recent 10 + block 4: the ring holds 16 rows, demotions stay aligned
    options = dict(sink=4, recent=10, block=4)
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", **options), max_new_tokens=40)
    cache = OscarCache(tiny, "quarot-int2", **options)
    assert torch.equal(fast(tiny, ids, cache, max_new_tokens=40), want)


def test_static_sampling_matches_the_eager_cache(tiny):
    ids = prompts([24])[0][None]
    options = dict(do_sample=True, top_k=20, temperature=0.8, max_new_tokens=30)
    torch.manual_seed(7)
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), **options)
    torch.manual_seed(7)
    assert torch.equal(fast(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), **options), want)


def test_short_prompts_decode_eagerly_until_the_sink_is_complete(tiny, static_steps):
    ids = prompts([2])[0][None]  # the next 2 tokens still go to the 4-token sink
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), max_new_tokens=20)
    assert torch.equal(fast(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), max_new_tokens=20), want)
    assert static_steps["steps"] == 19 - 2


def test_a_thawed_cache_continues_a_conversation_like_the_eager_one(tiny):
    turn1 = prompts([20])[0][None]
    eager, frozen = OscarCache(tiny, "quarot-int2", **SMALL), OscarCache(tiny, "quarot-int2", **SMALL)
    out1 = generate(tiny, turn1, eager, max_new_tokens=13)
    # bit for bit: unfused, as a stacked GEMM may round k and v differently on a GPU
    assert torch.equal(fast(tiny, turn1, frozen, max_new_tokens=13, fuse_projections=False), out1)
    for left, right in zip(eager.layers, frozen.layers):  # the ring unrolled back into the eager layout
        assert left.history_length == right.history_length
        assert torch.equal(left.recent_keys.view(), right.recent_keys.view())
        assert torch.equal(left.history_keys.packed().codes, right.history_keys.packed().codes)
    turn2 = torch.cat([out1, prompts([7], seed=3)[0][None]], dim=1)
    want = generate(tiny, turn2, eager, max_new_tokens=9)
    assert torch.equal(fast(tiny, turn2, frozen, max_new_tokens=9, fuse_projections=False), want)


def test_max_cache_len_preallocates_the_history_once(tiny):
    cache = OscarCache(tiny, "quarot-int2", max_cache_len=80, **SMALL)
    out = fast(tiny, prompts([30])[0][None], cache, max_new_tokens=40)
    codes = cache.layers[0].history_keys.codes
    assert codes.data.shape[2] == aligned_rows(80 - SMALL["sink"])  # the preallocated buffer, never regrown
    assert cache.get_seq_length() == out.shape[1] - 1


def test_freezing_keeps_a_preallocated_history_in_place_with_a_padded_sink(tiny):
    ids, mask = left_pad(prompts([30, 26]))  # the sink grows to 8 rows: fewer history rows are needed
    cache = OscarCache(tiny, "quarot-int2", max_cache_len=80, **SMALL)
    with torch.no_grad():
        tiny(ids, attention_mask=mask, use_cache=True, **{cache_keyword(tiny): cache})
    before = cache.layers[0].history_keys.codes.data.data_ptr()
    assert cache.start_static(attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1))
    assert cache.layers[0].history_keys.codes.data.data_ptr() == before  # no copy of the history


def test_a_full_static_cache_raises_instead_of_overwriting(tiny):
    cache = OscarCache(tiny, "quarot-int2", **SMALL)
    with torch.no_grad():
        tiny(prompts([30])[0][None], use_cache=True, **{cache_keyword(tiny): cache})
    assert cache.start_static(capacity=34)  # 18 rows of history (capacity 30), 8 in the ring
    for _ in range(12):  # three demotions of 4 rows fit
        cache.static.advance_host()
    with pytest.raises(RuntimeError, match="static OscarCache is full"):
        for _ in range(4):
            cache.static.advance_host()


def test_caches_that_cannot_be_frozen_say_why(tiny, caplog):
    caplog.set_level(logging.DEBUG, logger="oscar_hf")
    ids, mask = left_pad(prompts([30, 26]))
    cache = OscarCache(tiny, "quarot-int2", **SMALL)
    assert not cache.start_static(100)
    assert "prefill has not run" in caplog.text
    with torch.no_grad():
        tiny(ids, attention_mask=mask, use_cache=True, **{cache_keyword(tiny): cache})
    assert cache.start_static() and cache.static.grows  # no capacity given: it grows when full
    cache.stop_static()
    gap = torch.ones(2, 31, dtype=torch.long)
    gap[0, 10] = 0
    assert not cache.start_static(100, gap)
    assert "pads after the sink" in caplog.text
    cache.layers[1].device = torch.device("meta")  # as if device_map had put it on another GPU
    assert not cache.start_static(100)
    assert "several devices" in caplog.text
    cache.layers[1].device = cache.layers[0].device
    none = OscarCache(tiny, "none")
    with torch.no_grad():
        tiny(ids, attention_mask=mask, use_cache=True, **{cache_keyword(tiny): none})
    assert not none.start_static(100)
    assert "keeps everything in BF16" in caplog.text
    assert graphs_unsupported([layer for layer in none.layers if isinstance(layer, OscarLayer)], 16) is not None


def test_models_with_sliding_window_layers_decode_eagerly(static_steps):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    layer_types = ["sliding_attention", "full_attention"]
    config = Gemma3TextConfig(**dict(TINY, sliding_window=8, max_position_embeddings=512, layer_types=layer_types))
    model = Gemma3ForCausalLM(config).eval()
    model.set_attn_implementation("oscar")
    ids = prompts([30])[0][None]
    want = generate(model, ids, OscarCache(model, "quarot-int2", **SMALL), max_new_tokens=8)
    assert torch.equal(fast(model, ids, OscarCache(model, "quarot-int2", **SMALL), max_new_tokens=8), want)
    assert static_steps["steps"] == 0


def test_generate_is_plain_generate_on_cpu_and_validates(tiny, static_steps):
    ids = prompts([30])[0][None]
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), max_new_tokens=8)
    assert torch.equal(fast(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), capture=None, max_new_tokens=8), want)
    assert static_steps["steps"] == 0  # no CUDA graphs here: transformers' own loop, untouched
    with pytest.raises(ValueError, match="needs an OscarCache"):
        oscar_hf.generate(tiny, ids, max_new_tokens=2)
    if not CUDA:
        with pytest.raises(ValueError, match="needs a CUDA model"):
            fast(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), capture=True, max_new_tokens=8)


def test_compile_modes_that_capture_graphs_of_their_own_are_refused(tiny):
    cache = OscarCache(tiny, "quarot-int2", **SMALL)
    with pytest.raises(ValueError, match="cannot run inside the step's graph"):
        oscar_hf.StaticDecoder(tiny, cache, capture=False, compile="reduce-overhead")
    decoder = oscar_hf.StaticDecoder(tiny, cache, capture=False, compile="max-autotune-no-cudagraphs")
    assert len(decoder.compiled_layers) == len(tiny.model.layers)


def test_beam_search_decodes_eagerly(tiny, static_steps):
    ids = prompts([30])[0][None]
    options = dict(num_beams=2, max_new_tokens=6)
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), **options)
    assert torch.equal(fast(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), **options), want)
    assert static_steps["steps"] == 0


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize("fuse", [False, True], ids=["separate-projections", "fused-projections"])
def test_compiled_layers_in_the_static_step_keep_the_tokens(static_steps, fuse):
    # More layers than Dynamo's recompile limit (8): a graph per layer would leave the last ones eager.
    model = tiny_model("qwen3", num_hidden_layers=10)
    ids = prompts([30])[0][None]
    want = generate(model, ids, OscarCache(model, "quarot-int2", **SMALL), max_new_tokens=10)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = fast(
        model, ids, OscarCache(model, "quarot-int2", **SMALL), compile=True, fuse_projections=fuse, max_new_tokens=10
    )
    assert torch.equal(got, want)
    assert static_steps["steps"] == 9
    assert "forward" not in model.model.layers[0].__dict__  # the eager layers are back
    assert "forward" not in model.model.layers[0].mlp.up_proj.__dict__  # and the unfused projections
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] <= 6  # one set of graphs for every layer and step (a graph per layer: 11)


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler")
def test_every_compiled_graph_is_built_in_the_first_static_step(monkeypatch):
    """The second static step is the one a CUDA graph captures: nothing may compile there (a compile
    can time kernels, which a capturing stream forbids), also for a new batch size in the same process."""
    model = tiny_model("qwen3", num_hidden_layers=3)
    compiled_per_step = []
    run = oscar_hf.StaticDecoder._run

    def counting(self):
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        logits = run(self)
        compiled_per_step.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
        return logits

    monkeypatch.setattr(oscar_hf.StaticDecoder, "_run", counting)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for batch in (1, 2):
        compiled_per_step.clear()
        fast(
            model,
            prompts([30])[0][None].repeat(batch, 1),
            OscarCache(model, "quarot-int2", **SMALL),
            compile=True,
            max_new_tokens=5,
        )
        assert compiled_per_step[0] > 0 and compiled_per_step[1:] == [0, 0, 0], (batch, compiled_per_step)


def test_fused_projections_in_the_static_step_keep_the_tokens(tiny, static_steps):
    ids = prompts([30])[0][None]
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), max_new_tokens=12)
    before = {name: p.clone() for name, p in tiny.named_parameters()}
    got = fast(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), fuse_projections=True, max_new_tokens=12)
    assert torch.equal(got, want)
    assert static_steps["steps"] == 11
    assert all(torch.equal(p, before[name]) for name, p in tiny.named_parameters())  # unfused on leaving
    assert "forward" not in tiny.model.layers[0].self_attn.q_proj.__dict__


@pytest.mark.parametrize("fuse", [False, True], ids=["separate-projections", "fused-projections"])
def test_a_step_of_fused_projections_is_kept_no_longer_than_they_are(tiny, fuse):
    """Unfusing frees the stacked weights a captured step reads: after it, neither a later freeze of the
    same cache nor the model's next cache may replay that step. A step of separate projections is kept."""
    release_captured_steps(tiny)
    cache = OscarCache(tiny, "quarot-int2", decode_graphs=False, **SMALL)
    forward(tiny, prompts([30])[0][None], cache)
    decoder = oscar_hf.StaticDecoder(tiny, cache, capacity=64, capture=False, fuse_projections=fuse)

    def steps():
        for _ in range(3):
            decoder.step({"input_ids": torch.zeros(1, 1, dtype=torch.long), cache_keyword(tiny): decoder.cache})

    steps()
    step = decoder.current
    decoder.stop()
    assert (decoder.current is step) is not fuse
    steps()
    assert (decoder.current is step) is not fuse and (decoder.fusion is not None) is fuse
    del cache  # the decoder's cache ends: its step is left with the model, unless it ran fused
    assert (tiny in idle_steps()) is not fuse
    assert "forward" not in tiny.model.layers[0].self_attn.q_proj.__dict__  # unfused when the cache ended
    release_captured_steps(tiny)


# ------------------------------------------------------------- plain generate on a frozen cache


def frozen(model, method="quarot-int2", **options):
    """A cache that plain generate freezes on any device (on CPU: the static steps without graphs)."""
    return OscarCache(model, method, decode_graphs=True, **{**SMALL, **options})


@pytest.mark.parametrize("method", ["quarot-int2", "int4", K3V2])
def test_plain_generate_freezes_at_the_first_step_and_keeps_the_eager_tokens(tiny, method, static_steps):
    ids, mask = left_pad(prompts([30, 26, 29]))  # the sink's pads: its mask is taken from the step's mask
    want = generate(tiny, ids, OscarCache(tiny, method, **SMALL), attention_mask=mask, max_new_tokens=40)
    cache = frozen(tiny, method)
    got = generate(tiny, ids, cache, attention_mask=mask, max_new_tokens=40)
    assert torch.equal(got, want)
    assert static_steps["steps"] == 39 and cache.static is not None and cache.static.grows
    assert cache.get_seq_length() == got.shape[1] - 1


def test_a_frozen_cache_grows_when_its_history_is_full(tiny, monkeypatch, static_steps):
    import oscar_hf.core.freezing

    monkeypatch.setattr(oscar_hf.core.freezing, "MAX_SLACK_ROWS", 8)  # grow every 8 rows instead of every 4,096
    ids = prompts([30])[0][None]
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), max_new_tokens=120)
    cache = frozen(tiny)
    capacities = []

    def growing(self):
        capacities.append(self.static.capacity)
        grow(self)

    grow = OscarCache._grow_frozen
    monkeypatch.setattr(OscarCache, "_grow_frozen", growing)
    assert torch.equal(generate(tiny, ids, cache, max_new_tokens=120), want)
    assert static_steps["steps"] == 119
    # full at 4 + 32 history rows, then the full history and a block (8 rows) more each time, rounded up
    # to whole 8 rows and allocated in whole 16 rows: it grows instead of overflowing
    assert capacities[:3] == [36, 52, 68] and cache.static.capacity > capacities[-1]
    assert cache.static.replay and cache.static.grows  # the grown cache still replays graphs (where CUDA has them)


def test_plain_generate_freezes_a_long_history_where_the_prefill_put_it(tiny, monkeypatch):
    import oscar_hf.core.freezing
    import oscar_hf.core.storage

    for module in (oscar_hf.core.freezing, oscar_hf.core.storage):  # buckets of 32 rows instead of 4,096
        monkeypatch.setattr(module, "MAX_SLACK_ROWS", 32)
    ids = prompts([120])[0][None]
    cache = frozen(tiny)
    forward(tiny, ids[:, :-1], cache)  # the prompt but its last token, which generate's first step takes
    history = cache.layers[0].history_keys.codes
    assert history.length >= 64 and history.data.shape[2] % 32 == 0  # long enough for whole buckets
    before = history.data.data_ptr()
    generate(tiny, ids, cache, max_new_tokens=3)
    assert cache.static is not None and history.data.data_ptr() == before  # frozen with no copy


def test_a_frozen_cache_thaws_for_the_next_turn_and_freezes_again(tiny, static_steps):
    eager, cache = OscarCache(tiny, "quarot-int2", **SMALL), frozen(tiny)
    turn = prompts([20])[0][None]
    for seed, new_tokens in ((3, 13), (4, 9)):
        want = generate(tiny, turn, eager, max_new_tokens=new_tokens)
        got = generate(tiny, turn, cache, max_new_tokens=new_tokens)
        assert torch.equal(got, want)
        turn = torch.cat([got, prompts([7], seed=seed)[0][None]], dim=1)
    assert static_steps["steps"] == 12 + 8
    # oscar_hf.generate freezes it again at a fixed capacity (no growth inside its captured step)
    want = generate(tiny, turn, eager, max_new_tokens=6)
    assert torch.equal(fast(tiny, turn, cache, max_new_tokens=6, fuse_projections=False), want)


def test_padding_after_the_sink_and_beam_search_keep_the_cache_eager(tiny, static_steps):
    ids, mask = left_pad(prompts([30, 26]))
    mask[0, 12] = 0  # a pad in the middle of a row: the static layout has no mask past the sink
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), attention_mask=mask, max_new_tokens=10)
    cache = frozen(tiny)
    assert torch.equal(generate(tiny, ids, cache, attention_mask=mask, max_new_tokens=10), want)
    assert static_steps["steps"] == 0 and cache.stays_eager
    cache.reset()
    assert not cache.stays_eager
    ids = prompts([30])[0][None]
    options = dict(num_beams=2, max_new_tokens=6)
    want = generate(tiny, ids, OscarCache(tiny, "quarot-int2", **SMALL), **options)
    cache = frozen(tiny)
    assert torch.equal(generate(tiny, ids, cache, **options), want)
    assert cache.stays_eager and static_steps["steps"] == 1  # frozen once, thawed by the first reordering


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("max_cache_len", [400, None])
def test_plain_generate_on_gpu_replays_whole_steps(arch, max_cache_len, monkeypatch):
    """A cache made from the model: its first one-token step freezes it and runs eagerly (compiling the
    decoder layers and the kernels), every later step is one graph replay; a fresh cache of the same
    shapes captures its first step at once. Float32: the eager cache's tokens, compiled layers and all."""
    model = tiny_model(arch, head_dim=64).to("cuda")
    ids, mask = left_pad(prompts([300, 290]))
    ids, options = ids.cuda(), dict(attention_mask=mask.cuda(), max_new_tokens=64)
    rotations = oscar_hf.RotationSet.hadamard(64, [0, 1])
    want = generate(
        model, ids, OscarCache(model, "oscar-int2", rotations=rotations, decode_graphs=False, **SMALL), **options
    )
    replays = count_replays(monkeypatch)
    for replayed_steps in (62, 63):  # of 63 one-token steps; a growing cache holds 4,096 history rows here
        cache = OscarCache(model, "oscar-int2", rotations=rotations, max_cache_len=max_cache_len, **SMALL)
        replays["count"] = 0
        assert torch.equal(generate(model, ids, cache, **options), want)
        assert cache.step_decoder.graph is not None and cache.static.replayed is None
        assert cache.step_decoder.compiled_layers and replays["count"] == replayed_steps


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_fresh_cache_replays_the_graph_a_gone_cache_left_on_gpu(arch, monkeypatch):
    """The graph reads only tensors the step holds: a cache with other rotations and another prompt moves
    into them and decodes its own tokens without a capture of its own (float32: the eager tokens)."""
    model = tiny_model(arch, head_dim=64).to("cuda")
    layers = list(range(model.config.num_hidden_layers))
    sets = [random_rotations(layers, head_dim=64, seed=seed) for seed in (1, 2)]
    first, second = (ids[None].cuda() for ids in prompts([300, 300], seed=3))
    generate(model, first, OscarCache(model, "oscar-int2", rotations=sets[0], **SMALL), max_new_tokens=64)
    release_captured_steps(model)  # the shapes ran: the next cache captures its first step at once
    cache = OscarCache(model, "oscar-int2", rotations=sets[0], **SMALL)
    generate(model, first, cache, max_new_tokens=64)
    graph = cache.step_decoder.graph
    del cache  # its rotations go with it: the graph must not read them
    eager = OscarCache(model, "oscar-int2", rotations=sets[1], decode_graphs=False, **SMALL)
    want = generate(model, second, eager, max_new_tokens=64)
    captures = {"count": 0}
    begin = torch.cuda.CUDAGraph.capture_begin

    def counting(self, *args, **kwargs):
        captures["count"] += 1
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counting)
    cache = OscarCache(model, "oscar-int2", rotations=sets[1], **SMALL)
    assert torch.equal(generate(model, second, cache, max_new_tokens=64), want)
    assert cache.step_decoder.graph is graph and captures["count"] == 0


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
def test_a_captured_step_of_fused_projections_is_not_replayed_once_unfused_on_gpu():
    """The benchmark's sequence: a StaticDecoder with fused projections captures its step and stops (the
    stacked weights freed, their memory reused), its cache ends, then oscar_hf.generate decodes a fresh
    cache with fused projections too. Replaying the first step would read the freed stacked weights."""
    model = tiny_model("qwen3", head_dim=64).to("cuda")
    release_captured_steps(model)
    rotations = oscar_hf.RotationSet.hadamard(64, [0, 1])
    ids = prompts([300], seed=3)[0][None].cuda()
    make = functools.partial(OscarCache, model, "oscar-int2", rotations=rotations, max_cache_len=400, **SMALL)
    want = generate(
        model,
        ids,
        OscarCache(model, "oscar-int2", rotations=rotations, decode_graphs=False, **SMALL),
        max_new_tokens=32,
    )
    cache = make()
    forward(model, ids, cache)
    decoder = oscar_hf.StaticDecoder(model, cache, compile=True, fuse_projections=True)
    for _ in range(3):  # freeze, warm up, capture
        decoder.step({"input_ids": ids[:, -1:], cache_keyword(model): cache})
    stacked = [p.shape for name, p in model.named_parameters() if "oscar_stacked" in name]
    decoder.stop()
    junk = [torch.full(shape, float("nan"), device="cuda") for shape in stacked]  # takes the freed blocks
    del decoder, cache
    assert torch.equal(fast(model, ids, make(), capture=True, compile=True, max_new_tokens=32), want)
    del junk


def count_replays(monkeypatch) -> dict:
    counts = {"count": 0}
    replay = torch.cuda.CUDAGraph.replay

    def counting(self):
        counts["count"] += 1
        return replay(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting)
    return counts


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_cache_made_from_a_config_replays_each_layers_attention_on_gpu(arch):
    model = tiny_model(arch, head_dim=64).to("cuda")
    ids, mask = left_pad(prompts([300, 290]))
    ids, options = ids.cuda(), dict(attention_mask=mask.cuda(), max_new_tokens=64)
    rotations = oscar_hf.RotationSet.hadamard(64, [0, 1])
    want = generate(
        model, ids, OscarCache(model, "oscar-int2", rotations=rotations, decode_graphs=False, **SMALL), **options
    )
    cache = OscarCache(model.config, "oscar-int2", rotations=rotations, max_cache_len=400, **SMALL)
    assert torch.equal(generate(model, ids, cache, **options), want)
    calls = cache.static.replayed
    assert len(calls) == 1 + 2  # the advance and each layer's attention
    assert all(call.graph is not None for call in calls.values())
    assert {call.calls for call in calls.values()} == {63}  # every step since the first decode step


def captured_and_eager(arch: str, dtype: torch.dtype, **options):
    """Greedy decoding of a tiny random model on the GPU: the eager cache's output, then the captured one's."""
    model = tiny_model(arch, head_dim=64).to("cuda", dtype)
    ids, mask = left_pad(prompts([300, 290]))
    ids, options = ids.cuda(), dict(attention_mask=mask.cuda(), max_new_tokens=64, **options)
    rotations = oscar_hf.RotationSet.hadamard(64, [0, 1])
    want = generate(
        model, ids, OscarCache(model, "oscar-int2", rotations=rotations, decode_graphs=False, **SMALL), **options
    )
    cache = OscarCache(model, "oscar-int2", rotations=rotations, max_cache_len=400, **SMALL)
    return want, fast(model, ids, cache, capture=True, **options)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_captured_float32_decoding_is_token_identical_to_the_eager_cache_on_gpu(arch):
    want, got = captured_and_eager(arch, torch.float32)
    assert torch.equal(got, want)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_captured_bf16_decoding_leaves_the_eager_tokens_only_at_ties_on_gpu(arch):
    """The captured step attends over a ring (its rows in storage order, wrapping), the eager one over
    the window in token order: the same sums in another order, so bf16 logits may differ in their
    last bits, and a greedy token may flip where two logits tie (measured: llama, step 38, a gap of 0)."""
    want, got = captured_and_eager(arch, torch.bfloat16, output_logits=True, return_dict_in_generate=True)
    eager, captured = torch.stack(want.logits).float(), torch.stack(got.logits).float()  # [step, batch, vocab]
    prompt = want.sequences.shape[1] - len(want.logits)
    tokens, got_tokens = want.sequences[:, prompt:], got.sequences[:, prompt:]
    differing = (tokens != got_tokens).any(dim=0).nonzero()
    first = int(differing[0]) if len(differing) else len(want.logits)
    ulp = 2.0 ** (torch.floor(torch.log2(eager.abs().max())) - 7)  # bf16's spacing at the largest logit
    # The same inputs up to `first` (and at it): logits agree to a few bf16 ulps.
    step_difference = (eager[: first + 1] - captured[: first + 1]).abs().amax(dim=(1, 2))
    assert step_difference.max() <= 4 * ulp, step_difference
    if first < len(want.logits):  # a flip is only allowed where the perturbation can explain it
        for row in (tokens[:, first] != got_tokens[:, first]).nonzero()[:, 0]:
            logits = eager[first, row]
            gap = logits[tokens[row, first]] - logits[got_tokens[row, first]]
            assert gap <= 2 * step_difference[first], (first, gap)


def test_static_greedy_with_per_layer_widths_is_token_identical_to_the_eager_cache(tiny, static_steps):
    """K4 in layer 0 and V1 in both layers: one demotion launch per format, each layer at its widths."""
    rotations = oscar_hf.RotationSet.hadamard(16, [0, 1])
    rotations.key_bits.update({0: 4})
    rotations.value_bits.update({0: 1, 1: 1})
    ids, mask = left_pad(prompts([30, 26, 29]))
    want = generate(
        tiny, ids, OscarCache(tiny, "oscar-int2", rotations=rotations, **SMALL), attention_mask=mask, max_new_tokens=40
    )
    cache = OscarCache(tiny, "oscar-int2", rotations=rotations, decode_graphs=True, **SMALL)
    got = generate(tiny, ids, cache, attention_mask=mask, max_new_tokens=40)
    assert torch.equal(got, want)
    assert static_steps["steps"] == 39 and cache.static is not None
    formats = sorted((d.format["bits"], len(d.sources)) for d in cache.static.demoters)
    assert formats == [(1, 2), (2, 1), (4, 1)]
    assert torch.equal(
        fast(
            tiny,
            ids,
            OscarCache(tiny, "oscar-int2", rotations=rotations, **SMALL),
            attention_mask=mask,
            max_new_tokens=40,
        ),
        want,
    )
