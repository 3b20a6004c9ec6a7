"""A stateful test of OscarCache: hypothesis runs random sequences of operations on a cache used by a
tiny random model with small windows, and checks every step against a reference built independently.

The reference (:class:`Expected`) keeps the exact K/V of every position, as transformers'
DynamicCache and SDPA compute them, and its own account of where each position sits (sink, packed
history, recent window, as the paper's cache layout). Each layer's attention is checked on its own:
given the inputs the layer received in the cache's forward, a DynamicCache forward of the same
attention module, whose past K/V are exact except at the positions in the history at attention time
(there the rotate, quantize, dequantize, unrotate round trip of :mod:`oscar_hf.quant` in that
tensor's format, :data:`FORMATS`), must give the layer's output. Checking layer by layer on the same
inputs makes the K/V both sides quantize bit-identical; comparing only the logits would let float
noise from earlier layers move a later layer's K/V across a rounding boundary, which changes a
whole row after quantization. After every step every layer's tiers, the length and whether the
cache is frozen (static layout) must match too.

Operations: prefill chunks of 1-40 tokens (the first of a batch left-padded), bursts of one-token
decode steps, ``crop``, ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``,
``copy.deepcopy`` (a saved copy that later takes over), ``reset``, freezing (``start_static``, and
``decode_graphs=True`` which freezes at one-token steps on CPU too) and thawing; one method of
:data:`METHODS` a run, with random orthogonal rotations (shared or per KV head, with per-layer clip
ratios and bit widths) for the calibrated ones.

``OSCAR_HF_STATEFUL_PROFILE=long`` runs many more and longer runs than the default ``ci`` profile.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from transformers import DynamicCache

from oscar_hf import METHODS, OscarCache, RotationSet, TensorQuantConfig, cache_keyword
from oscar_hf.core.compat import positive_crop_keeps_length
from oscar_hf.quant import dequantize, quantize
from oscar_hf.rotations.rotation_set import hadamard
from tests.conftest import TINY, forward, tiny_model

WINDOWS = dict(sink=4, recent=8, block=2)
LAYERS = range(TINY["num_hidden_layers"])
HEAD_DIM, KV_HEADS = TINY["head_dim"], TINY["num_key_value_heads"]
MAX_BATCH = 4
MAX_TOKENS = 160  # a run's sequences stay this short (the window is 8 tokens: plenty of demotions)
FROZEN_CAPACITY = MAX_TOKENS + 64  # start_static's capacity: never full within a run
# float32: the cache attends in the rotated basis through its kernels' torch references, the reference
# in the model's basis with SDPA; their attention outputs (of magnitude ~0.1) agree to ~1e-8, while
# leaving the history unquantized moves them by 1e-3 (int4) to 1e-2 (2 bits).
TOLERANCE = dict(atol=1e-6, rtol=1e-5)

PROFILES = {
    "ci": settings(
        max_examples=20,
        stateful_step_count=25,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ),
    "long": settings(
        max_examples=150,
        stateful_step_count=40,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ),
}
PROFILE = PROFILES[os.environ.get("OSCAR_HF_STATEFUL_PROFILE", "ci")]


def spec(bits: int, clip: float = 0.0, symmetric: bool = False) -> TensorQuantConfig:
    return TensorQuantConfig(bits, symmetric=symmetric, clip_ratio=clip)


# The (K, V) format each method stores each layer's history in, written out by hand from the rules
# (OscarConfig docs): calibrated methods take the rotations' per-layer clip ratios where the method
# clips at 2 bits, and oscar-int2 their per-layer bit widths (a changed width is not clipped).
# :func:`random_rotations` stores: layer 0 K 4 bits and V 1 bit, layer 1 V 1 bit; clips for layer 1.
_PLAIN = {
    "naive-int2": (spec(2, symmetric=True), spec(2, symmetric=True)),
    "quarot-int2": (spec(2), spec(2)),
    "int4": (spec(4), spec(4)),
}
FORMATS: dict[str, list[tuple[TensorQuantConfig, TensorQuantConfig]] | None] = {
    "none": None,
    **{name: [formats] * len(LAYERS) for name, formats in _PLAIN.items()},
    "oscar-int2": [(spec(4), spec(1)), (spec(2, 0.9), spec(1))],
    "oscar-int2-paper": [(spec(2, 0.96), spec(2, 0.92))] * 2,
    "oscar-k4v2": [(spec(4), spec(2, 0.92)), (spec(4), spec(2, 0.85))],
    "oscar-k3v2": [(spec(3, 0.96), spec(2, 0.92)), (spec(3, 0.96), spec(2, 0.85))],
}


@functools.cache
def models(arch: str):
    """The same tiny model twice: with the "oscar" attention (the cache's) and with SDPA (the reference's)."""
    return tiny_model(arch), tiny_model(arch, attn="sdpa")


@functools.cache
def random_rotations(per_head: bool) -> RotationSet:
    generator = torch.Generator().manual_seed(11)

    def orthogonal() -> torch.Tensor:
        q, r = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=generator, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()

    def rotation() -> torch.Tensor:
        return torch.stack([orthogonal() for _ in range(KV_HEADS)]) if per_head else orthogonal()

    # oscar-int2's budget: (4 + 1) + (2 + 1) bits = 2 layers x (2 + 2)
    return RotationSet(
        HEAD_DIM,
        {i: rotation() for i in LAYERS},
        {i: rotation() for i in LAYERS},
        "random",
        key_clip={1: 0.9},
        value_clip={1: 0.85},
        key_bits={0: 4},
        value_bits={0: 1, 1: 1},
    )


def method_rotations(
    method: str, rotations: RotationSet, layer: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """R_K and R_V of ``layer`` for ``method`` (None: the identity)."""
    kind = METHODS[method].rotation
    if kind == "identity":
        return None, None
    if kind == "hadamard":
        h = hadamard(HEAD_DIM).float()
        return h, h
    return rotations.key[layer], rotations.value[layer]


def _rotate(states: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``[B, H, T, D] @ R`` with R shared ``[D, D]`` or one per head ``[H, D, D]``."""
    return states if rotation is None else states @ rotation


def roundtrip(rotated: torch.Tensor, rotation: torch.Tensor | None, format: TensorQuantConfig) -> torch.Tensor:
    """What ``rotated`` states become in a history of ``format``, back in the model's basis."""
    group = format.group_of(HEAD_DIM)
    codes = quantize(
        rotated,
        format.bits,
        group,
        symmetric=format.symmetric,
        clip_ratio=format.clip_ratio,
        metadata_dtype=torch.bfloat16,
    )
    back = dequantize(codes, format.bits, group, torch.float32)
    return back if rotation is None else back @ rotation.mT


# ----------------------------------------------------------------------------------- reference


@dataclass
class Expected:
    """The reference state of a batch: tokens, exact K/V, history round trips and the tiers."""

    pads: torch.Tensor  # [B] left pads of each row
    ids: torch.Tensor  # [B, L]
    keys: list[torch.Tensor]  # per layer, exact [B, H, L, D]
    values: list[torch.Tensor]
    # per layer, exact K·R_K and V·R_V [B, H, L, D], each computed as its chunk arrived: a row rotated
    # alone or with others may differ in its last bit, and quantizing can turn that into a code apart
    rotated_keys: list[torch.Tensor]
    rotated_values: list[torch.Tensor]
    history_keys: list[torch.Tensor]  # per layer, round trips of the history positions [B, H, history, D]
    history_values: list[torch.Tensor]
    sink: int = 0
    history: int = 0
    sink_end: int | None = None  # fixed once every row has a real token
    frozen: bool = False
    stays_eager: bool = False

    @classmethod
    def start(cls, pads: torch.Tensor) -> "Expected":
        empty = [torch.empty(len(pads), KV_HEADS, 0, HEAD_DIM) for _ in LAYERS]
        return cls(pads, torch.empty(len(pads), 0, dtype=torch.long), *(list(empty) for _ in range(6)))

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @property
    def recent(self) -> int:
        return self.length - self.sink - self.history

    def mask(self, length: int) -> torch.Tensor:
        """``[B, length]`` attention mask: pads first, then real tokens."""
        return (torch.arange(length)[None] >= self.pads[:, None]).long()

    def sink_complete(self) -> bool:
        return self.sink_end is not None and (self.history > 0 or self.recent > 0 or self.sink >= self.sink_end)

    def plan(self, new: int, quantized: bool) -> tuple[int | None, int, int, int]:
        """Where ``new`` tokens go: (the sink's end, tokens to the sink, recent rows demoted before
        attention, new rows that go straight to the history)."""
        end, sink_end = self.length + new, self.sink_end
        if sink_end is None and bool((self.pads < end).all()):  # fixed once every row has started
            sink_end = int(self.pads.max()) + WINDOWS["sink"]
        filling = end + WINDOWS["sink"] if sink_end is None else sink_end  # until then all may precede a row's start
        to_sink = max(0, min(new, filling - self.sink)) if self.history == 0 and self.recent == 0 else 0
        window = self.recent + new - to_sink
        overflow = window - WINDOWS["recent"] if quantized and window >= WINDOWS["recent"] + WINDOWS["block"] else 0
        demote = min(overflow, self.recent)
        return sink_end, to_sink, demote, overflow - demote

    def past(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's past K/V as attention sees them: the history's round trips, the rest exact."""
        start, stop = self.sink, self.sink + self.history
        keys, values = self.keys[layer], self.values[layer]
        return (
            torch.cat([keys[:, :, :start], self.history_keys[layer], keys[:, :, stop:]], dim=2),
            torch.cat([values[:, :, :start], self.history_values[layer], values[:, :, stop:]], dim=2),
        )

    def arrive(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, rotated: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Append a chunk's exact K/V and their rotated copies to ``layer``."""
        for tensors, new in zip(
            (self.keys, self.values, self.rotated_keys, self.rotated_values), (keys, values, *rotated)
        ):
            tensors[layer] = torch.cat([tensors[layer], new], dim=2)

    def demote(self, count: int, quantize_layer) -> None:
        """Move the next ``count`` positions after the history into it; ``quantize_layer(layer, exact K,
        exact V, rotated K, rotated V)`` gives their K/V as the history holds them."""
        if not count:
            return
        start, stop = self.sink + self.history, self.sink + self.history + count
        for layer in LAYERS:
            rows = (
                t[layer][:, :, start:stop] for t in (self.keys, self.values, self.rotated_keys, self.rotated_values)
            )
            k, v = quantize_layer(layer, *rows)
            self.history_keys[layer] = torch.cat([self.history_keys[layer], k], dim=2)
            self.history_values[layer] = torch.cat([self.history_values[layer], v], dim=2)
        self.history += count

    def select(self, index: torch.Tensor) -> None:
        self.pads, self.ids = self.pads[index], self.ids[index]
        for tensors in (
            self.keys,
            self.values,
            self.rotated_keys,
            self.rotated_values,
            self.history_keys,
            self.history_values,
        ):
            tensors[:] = [t[index] for t in tensors]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions: the newest go from the window, then the history, then the sink."""
        self.ids = self.ids[:, :length]
        for tensors in (self.keys, self.values, self.rotated_keys, self.rotated_values):
            tensors[:] = [t[:, :, :length] for t in tensors]
        self.sink = min(self.sink, length)
        self.history = min(self.history, length - self.sink)
        for tensors in (self.history_keys, self.history_values):
            tensors[:] = [t[:, :, : self.history] for t in tensors]


def tiers(layer) -> tuple[int, int, int]:
    """(sink, history, recent) rows of an OscarLayer, eager or frozen."""
    if layer.static is not None:
        return layer.static.sink_rows, layer.static.history_rows, layer.static.ring_rows
    if not layer.is_initialized:
        return 0, 0, 0
    return layer.sink_keys.length, layer.history_length, layer.recent_keys.length


def attention_calls(model, input_ids: torch.Tensor, cache: OscarCache, **kwargs) -> list[tuple[dict, torch.Tensor]]:
    """A forward of ``model`` over ``cache``: each layer's attention inputs (keyword arguments) and output."""
    calls = {}

    def record(module, args, inputs, output):
        calls[module.layer_idx] = inputs, output[0]

    hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in model.model.layers]
    try:
        forward(model, input_ids, cache, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return [calls[layer] for layer in LAYERS]


# --------------------------------------------------------------------------------------- machine


class CacheMachine(RuleBasedStateMachine):
    """Random operations on one OscarCache and one :class:`Expected`; ``methods`` are drawn from."""

    methods: tuple[str, ...] = tuple(METHODS)
    exact_history = False  # the sensitivity check's broken reference: the history left unquantized

    @initialize(data=st.data())
    def setup(self, data):
        self.method = data.draw(st.sampled_from(self.methods), label="method")
        arch = data.draw(st.sampled_from(["llama", "qwen3"]), label="arch")
        per_head = not METHODS[self.method].shared_rotations and data.draw(st.booleans(), label="per_head")
        decode_graphs = data.draw(st.sampled_from([None, True]), label="decode_graphs")
        self.start(arch, per_head, decode_graphs, data.draw(st.integers(0, 2**16), label="token seed"))

    def start(self, arch: str, per_head: bool, decode_graphs: bool | None, token_seed: int) -> None:
        """A new cache of ``self.method`` on the tiny ``arch`` model, and no batch yet."""
        self.decode_graphs = decode_graphs
        self.model, self.reference_model = models(arch)
        self.rotations = random_rotations(per_head)
        self.cache = OscarCache(
            self.model, self.method, rotations=self.rotations, decode_graphs=self.decode_graphs, **WINDOWS
        )
        self.quantized = FORMATS[self.method] is not None
        self.expected: Expected | None = None  # None: the next prefill starts a new batch
        self.saved: tuple[OscarCache, Expected | None] | None = None
        self.tokens = torch.Generator().manual_seed(token_seed)

    # ------------------------------------------------------------------------------- steps
    @precondition(lambda self: self.expected is None or self.expected.length < MAX_TOKENS)
    @rule(data=st.data())
    def prefill(self, data):
        if self.expected is None:
            batch = data.draw(st.integers(1, 3), label="batch")
            pads = data.draw(st.lists(st.integers(0, 24), min_size=batch, max_size=batch), label="left pads")
            self.expected = Expected.start(torch.tensor(pads) - min(pads))
        chunk = data.draw(st.integers(1, 40), label="chunk")
        self.step(chunk)

    @precondition(lambda self: self.expected is not None and self.expected.length < MAX_TOKENS)
    @rule(steps=st.integers(1, 12))
    def decode(self, steps):
        for _ in range(steps):
            self.step(1)

    def step(self, new: int) -> None:
        """Feed ``new`` random tokens to the cache; each layer's attention output must be the reference's."""
        expected = self.expected
        batch, start = expected.pads.shape[0], expected.length
        self.expect_freezing(new)
        ids = torch.randint(3, TINY["vocab_size"], (batch, new), generator=self.tokens)
        mask = expected.mask(start + new)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, start:]
        calls = attention_calls(self.model, ids, self.cache, attention_mask=mask, position_ids=positions)
        expected.sink_end, to_sink, demote, quantize_new = expected.plan(new, self.quantized)
        expected.demote(demote, self.quantize_layer)  # before attention: this step sees them quantized
        reference = DynamicCache()
        for layer in LAYERS:
            reference.update(*expected.past(layer), layer)
        real = mask[:, start:].bool()
        for layer, (inputs, got) in enumerate(calls):
            attention = self.reference_model.model.layers[layer].self_attn
            with torch.no_grad():
                want, _ = attention(**{**inputs, cache_keyword(self.model): reference})
            torch.testing.assert_close(
                got[real],
                want[real],
                **TOLERANCE,
                msg=lambda m: f"{self.method}, layer {layer}, step of {new} at {start}: {m}",
            )
        expected.ids = torch.cat([expected.ids, ids], dim=1)
        for layer in LAYERS:
            keys, values = reference.layers[layer].keys[:, :, start:], reference.layers[layer].values[:, :, start:]
            rotations = method_rotations(self.method, self.rotations, layer)
            expected.arrive(layer, keys, values, (_rotate(keys, rotations[0]), _rotate(values, rotations[1])))
        expected.sink += to_sink
        expected.demote(quantize_new, self.quantize_layer)  # after attention: this step saw them exact

    def quantize_layer(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        rotated_keys: torch.Tensor,
        rotated_values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exact_history:
            return keys, values
        key_format, value_format = FORMATS[self.method][layer]
        key_rotation, value_rotation = method_rotations(self.method, self.rotations, layer)
        return roundtrip(rotated_keys, key_rotation, key_format), roundtrip(
            rotated_values, value_rotation, value_format
        )

    def expect_freezing(self, new: int) -> None:
        """What the step does to the static layout: a longer chunk thaws it; with decode_graphs a
        one-token step freezes it once the sink is complete."""
        expected = self.expected
        if new > 1:
            expected.frozen = False
        elif self.decode_graphs and self.quantized and not expected.stays_eager and expected.sink_complete():
            expected.frozen = True

    # ------------------------------------------------------------------- cache operations
    @precondition(lambda self: self.expected is not None)
    @rule(data=st.data())
    def crop(self, data):
        expected = self.expected
        remove = data.draw(st.integers(0, expected.recent + 2), label="remove")
        as_length = data.draw(st.booleans(), label="as a length to keep")  # transformers < 5.18's meaning
        keep = expected.length - remove
        argument = keep if as_length and remove and keep > 0 else -remove  # crop(0) removes nothing
        if argument > 0 and not positive_crop_keeps_length():  # refused before anything changes
            with pytest.raises(ValueError, match="negative"):
                self.cache.crop(argument)
            return
        self.thaw_for_good()
        if remove > expected.length:
            with pytest.raises(ValueError):
                self.cache.crop(argument)
            return
        self.cache.crop(argument)
        expected.crop(expected.length - remove)

    @precondition(lambda self: self.expected is not None)
    @rule(data=st.data())
    def reorder(self, data):
        batch = self.expected.pads.shape[0]
        beams = torch.tensor(
            data.draw(st.lists(st.integers(0, batch - 1), min_size=batch, max_size=batch), label="beams")
        )
        self.thaw_for_good()
        self.cache.reorder_cache(beams)
        self.expected.select(beams)

    @precondition(lambda self: self.expected is not None)
    @rule(data=st.data())
    def select(self, data):
        batch = self.expected.pads.shape[0]
        rows = data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch, unique=True), label="rows")
        self.thaw_for_good()
        self.cache.batch_select_indices(torch.tensor(rows))
        self.expected.select(torch.tensor(rows))

    @precondition(lambda self: self.expected is not None and 2 * self.expected.pads.shape[0] <= MAX_BATCH)
    @rule()
    def repeat(self):
        self.thaw_for_good()
        self.cache.batch_repeat_interleave(2)
        self.expected.select(torch.arange(self.expected.pads.shape[0]).repeat_interleave(2))

    def thaw_for_good(self) -> None:
        """Reordering or rolling back thaws a frozen cache, which plain generate then stops freezing."""
        if self.expected.frozen:
            self.expected.frozen, self.expected.stays_eager = False, True

    @rule()
    def save_copy(self):
        self.saved = copy.deepcopy(self.cache), copy.deepcopy(self.expected)

    @precondition(lambda self: self.saved is not None)
    @rule()
    def swap_with_copy(self):
        """The saved copy takes over, and the live cache is saved: neither may have changed the other."""
        live = self.cache, self.expected
        self.cache, self.expected = self.saved
        self.saved = live

    @rule()
    def reset(self):
        self.cache.reset()
        self.expected = None

    @precondition(lambda self: self.expected is not None)
    @rule()
    def freeze(self):
        expected = self.expected
        frozen = self.cache.start_static(FROZEN_CAPACITY, attention_mask=expected.mask(expected.length))
        assert frozen == (self.quantized and expected.sink_complete())
        expected.frozen = frozen

    @precondition(lambda self: self.expected is not None)
    @rule()
    def thaw(self):
        self.cache.stop_static()
        self.expected.frozen = False

    # ------------------------------------------------------------------------- invariants
    @invariant()
    def tiers_match(self):
        expected = self.expected
        if expected is None:
            assert self.cache.get_seq_length() == 0 and self.cache.static is None
            return
        want = (expected.sink, expected.history, expected.recent)
        for index, layer in enumerate(self.cache.layers):
            assert tiers(layer) == want, f"layer {index}: (sink, history, recent) {tiers(layer)} != {want}"
            if layer.is_initialized:
                assert layer.sink_end == expected.sink_end
            if self.quantized:
                assert (layer.config.key, layer.config.value) == FORMATS[self.method][index]
        assert self.cache.get_seq_length() == expected.length
        assert (self.cache.static is not None) == expected.frozen and self.cache.stays_eager == expected.stays_eager
        if self.quantized:  # the window demotes a block at a time: never above recent + block - 1
            assert expected.recent < WINDOWS["recent"] + WINDOWS["block"]


def machine_test(methods: tuple[str, ...], profile: settings = PROFILE, machine=CacheMachine) -> None:
    """Run ``machine`` over runs drawing from ``methods``."""
    run_state_machine_as_test(type(machine.__name__, (machine,), {"methods": methods}), settings=profile)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_random_operations_match_the_reference(method):
    machine_test((method,))


class ExactHistoryMachine(CacheMachine):
    exact_history = True


def test_a_reference_without_quantization_is_caught():
    """The same machine against a reference that keeps the history exact must fail: the check sees it."""
    quick = settings(PROFILE, max_examples=10, phases=[Phase.generate], derandomize=True, report_multiple_bugs=False)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        machine_test(("oscar-int2", "quarot-int2"), quick, ExactHistoryMachine)


def test_a_chunk_just_over_the_window_sends_its_oldest_rows_to_the_history():
    model = models("llama")[0]
    cache = OscarCache(model, "quarot-int2", **WINDOWS)
    forward(model, torch.arange(3, 8)[None], cache)  # the sink's 4 tokens and 1 in the window
    forward(model, torch.arange(8, 17)[None], cache)  # 9 more: 10 in the window, 2 over `recent`
    # the window's oldest row and the chunk's first go to the history, the last 8 (recent) stay
    assert [tiers(layer) for layer in cache.layers] == [(4, 2, 8)] * len(LAYERS)


@pytest.mark.parametrize("thaw", ["repeat", "thaw"])
def test_an_eager_step_after_a_frozen_step_that_demoted_matches_the_reference(thaw):
    """A cache frozen at a one-token step that demoted a block, then thawed, steps eagerly as the reference does."""
    machine = CacheMachine()
    machine.method = "oscar-int2-paper"
    machine.start("llama", per_head=False, decode_graphs=True, token_seed=0)
    machine.expected = Expected.start(torch.tensor([0, 1]))  # the second row left-padded by one
    machine.step(14)  # a sink of 5 rows and a full window of 9: the next token demotes a block
    machine.step(1)  # its update demotes the block, then its attention freezes the cache
    machine.tiers_match()
    getattr(machine, thaw)()
    machine.step(1)
    machine.tiers_match()
