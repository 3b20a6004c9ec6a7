"""Cache configurations: which bits, rotation, clipping and BF16 windows each named method uses.

Every method is a configuration of the same cache, so comparisons between them are apples to apples.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from oscar_hf.quant import check_bits, check_symmetric, pack_unit

ROTATION_KINDS = ("identity", "hadamard", "calibrated")
# The width a set's clip ratios were searched at unless it records another (its base_bits): a clip ratio
# suits one width only (a wider grid wants milder clipping).
SEARCHED_BITS = 2


def _is_count(value: object) -> bool:
    """An int that is not a bool (``True`` is an int to Python, never a number of tokens to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(owner: str, checks: dict[str, tuple[object, bool]]) -> None:
    """Raise ``TypeError`` naming the first field whose value has the wrong type."""
    for name, (value, ok) in checks.items():
        if not ok:
            raise TypeError(f"{owner}.{name} has the wrong type: {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class TensorQuantConfig:
    """How one of K or V is quantized once it leaves the BF16 windows.

    ``bits`` is 1, 2, 3 or 4 (1-bit rows take levels ``mu +- 0.798 sigma``, see :mod:`oscar_hf.quant`);
    ``group_size`` ``None`` means one (scale, zero) per row (G = head_dim); ``clip_ratio`` 0 disables
    clipping.
    """

    bits: int = 2
    symmetric: bool = False
    clip_ratio: float = 0.0
    group_size: int | None = None

    def __post_init__(self) -> None:
        _check_types(
            "TensorQuantConfig",
            {
                "bits": (self.bits, _is_count(self.bits)),
                "symmetric": (self.symmetric, isinstance(self.symmetric, bool)),
                "clip_ratio": (
                    self.clip_ratio,
                    isinstance(self.clip_ratio, (int, float)) and not isinstance(self.clip_ratio, bool),
                ),
                "group_size": (self.group_size, self.group_size is None or _is_count(self.group_size)),
            },
        )

    def validate(self, name: str, head_dim: int) -> None:
        check_bits(self.bits)
        check_symmetric(self.bits, self.symmetric)
        if not 0.0 <= self.clip_ratio <= 1.0:
            raise ValueError(f"{name}: clip_ratio must be in [0, 1], got {self.clip_ratio}")
        group, unit = self.group_of(head_dim), pack_unit(self.bits)
        if group <= 0 or head_dim % group or group % unit:
            raise ValueError(
                f"{name}: group_size {self.group_size} must be a positive divisor of head_dim {head_dim} "
                f"and a multiple of {unit}"
            )

    def group_of(self, head_dim: int) -> int:
        return head_dim if self.group_size is None else self.group_size


@dataclass(frozen=True)
class OscarConfig:
    """A full cache configuration.

    ``key``/``value`` ``None`` keeps that tensor in the model's dtype (only the ``none`` method does
    this, for both). ``sink`` first real tokens and the last ``recent`` (up to ``recent + block - 1``)
    tokens stay in high precision; the window is demoted ``block`` tokens at a time. With
    ``layer_clip``, per-layer clip ratios stored with calibrated rotations replace the fixed ratio
    of every tensor the method clips at the width they were searched at (the set's ``base_bits``). With ``layer_bits``, per-layer bit widths stored with
    calibrated rotations (e.g. K at 4 bits in the most sensitive layers, paid for by V at 1 bit in
    others) replace the widths of the method they were allocated for (the set's ``base_bits``); they
    must keep the method's history bits (see :func:`check_bit_budget`) unless ``allow_bits_change``. ``shared_rotations`` asks for the
    reference implementation's rotations: one per layer for all its KV heads, and, from a bundled
    set, the one made without the clip search. With ``key_feedback``, keys of 2 bits or more take the
    feedback factors stored with calibrated rotations (:attr:`~oscar_hf.rotations.rotation_set.RotationSet.key_feedback`).
    """

    method: str = "custom"
    key: TensorQuantConfig | None = field(default_factory=TensorQuantConfig)
    value: TensorQuantConfig | None = field(default_factory=TensorQuantConfig)
    rotation: str = "calibrated"
    sink: int = 64
    recent: int = 256
    block: int = 8
    metadata_dtype: torch.dtype = torch.bfloat16
    check_finite: bool = False
    layer_clip: bool = True
    shared_rotations: bool = False
    layer_bits: bool = True
    allow_bits_change: bool = False
    key_feedback: bool = True

    def __post_init__(self) -> None:
        flags = ("check_finite", "layer_clip", "shared_rotations", "layer_bits", "allow_bits_change", "key_feedback")
        _check_types(
            "OscarConfig",
            {
                **{name: (getattr(self, name), _is_count(getattr(self, name))) for name in ("sink", "recent", "block")},
                **{name: (getattr(self, name), isinstance(getattr(self, name), bool)) for name in flags},
                **{
                    name: (
                        getattr(self, name),
                        getattr(self, name) is None or isinstance(getattr(self, name), TensorQuantConfig),
                    )
                    for name in ("key", "value")
                },
            },
        )

    @property
    def quantized(self) -> bool:
        return self.key is not None

    def validate(self, head_dim: int) -> None:
        """Raise ``ValueError`` for any setting this cache cannot honour."""
        if (self.key is None) != (self.value is None):
            raise ValueError("K and V must both be quantized or both kept in high precision")
        if self.rotation not in ROTATION_KINDS:
            raise ValueError(f"rotation must be one of {ROTATION_KINDS}, got {self.rotation!r}")
        if self.sink < 0:
            raise ValueError(f"sink must be a non-negative number of tokens, got {self.sink}")
        if self.recent < 1:
            # Each decode step's token joins the window before attention reads it (the kernels, static
            # decoding and the teacher-forced evaluator all rely on that).
            raise ValueError(f"recent must be at least 1 token, got {self.recent}")
        if self.block < 1:
            raise ValueError(f"block must be a positive number of tokens, got {self.block}")
        if self.metadata_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"metadata_dtype must be bfloat16, float16 or float32, got {self.metadata_dtype}")
        if self.key is not None:
            self.key.validate("key", head_dim)
            self.value.validate("value", head_dim)

    def for_layer(
        self,
        key_clip: float | None = None,
        value_clip: float | None = None,
        key_bits: int | None = None,
        value_bits: int | None = None,
        base_bits: tuple[int, int] = (SEARCHED_BITS, SEARCHED_BITS),
    ) -> "OscarConfig":
        """This config with a layer's calibrated clip ratios (see ``layer_clip``) and bit widths (see
        ``layer_bits``) applied; only calibrated methods take them. ``base_bits`` are the (K, V) widths the
        clip search measured at and the allocation traded against: clip ratios apply only to tensors at
        that width, bit widths only to a method quantizing at those widths.

        A tensor whose width the layer changes is quantized without clipping: the clip ratios were
        chosen for the method's width, and 4-bit min-max keys and 1-bit sigma-level values need none.
        """
        if not (self.quantized and self.rotation == "calibrated"):
            return self
        key, value = self.key, self.value
        if self.layer_clip:
            if key_clip is not None and key.clip_ratio > 0 and key.bits == base_bits[0]:
                key = replace(key, clip_ratio=float(key_clip))
            if value_clip is not None and value.clip_ratio > 0 and value.bits == base_bits[1]:
                value = replace(value, clip_ratio=float(value_clip))
        if self.layer_bits and self.takes_widths_for(base_bits):
            key, value = _with_bits(key, key_bits), _with_bits(value, value_bits)
        return replace(self, key=key, value=value)

    def takes_widths_for(self, base_bits: tuple[int, int]) -> bool:
        """Whether per-layer widths allocated against (K, V) widths ``base_bits`` fit this method:
        a calibrated method quantizing K and V at exactly those widths."""
        return self.quantized and self.rotation == "calibrated" and (self.key.bits, self.value.bits) == tuple(base_bits)

    def with_overrides(self, **overrides) -> "OscarConfig":
        """A copy with some fields replaced (e.g. ``sink=4, recent=16`` for tests)."""
        return replace(self, **overrides)


def _with_bits(spec: TensorQuantConfig, bits: int | None) -> TensorQuantConfig:
    if bits is None or bits == spec.bits:
        return spec
    return replace(spec, bits=int(bits), clip_ratio=0.0)


def _history_code_bits(configs: list[OscarConfig]) -> int:
    """Code bits one token takes in the histories of these layers, per channel: the sum of K and V widths."""
    return sum(c.key.bits + c.value.bits for c in configs if c.quantized)


def check_bit_budget(config: OscarConfig, layers: list[OscarConfig]) -> None:
    """Raise ``ValueError`` unless per-layer bit widths keep ``config``'s history size.

    The rule: the sum over the quantized layers of (K bits + V bits) must equal that of ``config``
    in every one of them, i.e. the average history bits per element stay the method's (metadata is
    one (scale, zero) per group at any width, so it does not change). K at 4 bits in N layers of
    ``oscar-int2`` is paid for by V at 1 bit in 2N layers; in ``oscar-k3v2``, by V at 1 bit in N layers. ``config.allow_bits_change`` lifts the check.
    """
    if config.allow_bits_change or not config.quantized:
        return
    expected, got = _history_code_bits([config] * len(layers)), _history_code_bits(layers)
    if got != expected:
        count = sum(c.quantized for c in layers)
        raise ValueError(
            f"the per-layer bit widths of the rotations give {got / (2 * count):.4g} code bits per history element "
            f"where method {config.method!r} takes {expected / (2 * count):.4g} (sum over layers of K + V bits "
            f"{got} != {expected}); rebalance the allocation, pass allow_bits_change=True to accept it, or "
            "layer_bits=False to ignore it"
        )


K_CLIP, V_CLIP = 0.96, 0.92  # the reference implementation's fixed clip ratios

METHODS: dict[str, OscarConfig] = {
    "none": OscarConfig("none", key=None, value=None, rotation="identity"),
    "naive-int2": OscarConfig(
        "naive-int2", TensorQuantConfig(2, symmetric=True), TensorQuantConfig(2, symmetric=True), "identity"
    ),
    "quarot-int2": OscarConfig("quarot-int2", TensorQuantConfig(2), TensorQuantConfig(2), "hadamard"),
    # The best 2-bit recipe: with clip-searched rotations (the bundled sets, `oscar-hf calibrate`)
    # each layer takes its searched clip ratios; with per-KV-head rotations, one per head.
    "oscar-int2": OscarConfig(
        "oscar-int2", TensorQuantConfig(2, clip_ratio=K_CLIP), TensorQuantConfig(2, clip_ratio=V_CLIP), "calibrated"
    ),
    # The paper's recipe, to reproduce its numbers: one U·H·P rotation per layer, fixed clips, 2 bits everywhere,
    # round-to-nearest keys.
    "oscar-int2-paper": OscarConfig(
        "oscar-int2-paper",
        TensorQuantConfig(2, clip_ratio=K_CLIP),
        TensorQuantConfig(2, clip_ratio=V_CLIP),
        "calibrated",
        layer_clip=False,
        layer_bits=False,
        shared_rotations=True,
        key_feedback=False,
    ),
    "int4": OscarConfig("int4", TensorQuantConfig(4), TensorQuantConfig(4), "hadamard"),
    "oscar-k4v2": OscarConfig(
        "oscar-k4v2", TensorQuantConfig(4), TensorQuantConfig(2, clip_ratio=V_CLIP), "calibrated"
    ),
    # ~3 bits per element in the history at head_dim 64: K 3 + 32/64 = 3.5 bits, V 2.5.
    "oscar-k3v2": OscarConfig(
        "oscar-k3v2", TensorQuantConfig(3, clip_ratio=K_CLIP), TensorQuantConfig(2, clip_ratio=V_CLIP), "calibrated"
    ),
}


def resolve_method(method: str | OscarConfig, **overrides) -> OscarConfig:
    """Turn a method name (see :data:`METHODS`) or a config into a config, applying field overrides."""
    if isinstance(method, OscarConfig):
        config = method
    elif method in METHODS:
        config = METHODS[method]
    else:
        raise ValueError(f"unknown method {method!r}; choose one of {sorted(METHODS)} or pass an OscarConfig")
    if "offloading" in overrides:
        raise ValueError("OscarCache does not support offloading: its packed history is already ~7x smaller than BF16")
    unknown = sorted(set(overrides) - {f.name for f in fields(OscarConfig)})
    if unknown:
        raise ValueError(
            f"unknown OscarCache option(s) {unknown}; OscarConfig fields are {[f.name for f in fields(OscarConfig)]}"
        )
    return config.with_overrides(**overrides) if overrides else config
