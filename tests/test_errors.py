"""Bad input raises clear errors instead of corrupting the cache."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from oscar_hf import OscarCache, OscarConfig, RotationSet, TensorQuantConfig
from tests.conftest import TINY, forward


def config(**overrides):
    return LlamaConfig(**{**TINY, **overrides})


def test_wrong_rotation_shape():
    bad = RotationSet(8, key={0: torch.eye(8), 1: torch.eye(8)}, value={0: torch.eye(8), 1: torch.eye(8)})
    with pytest.raises(ValueError, match="head_dim=8 but the model has head_dim=16"):
        OscarCache(config(), "oscar-int2", rotations=bad)


def test_missing_or_extra_rotation_layers():
    with pytest.raises(ValueError, match="missing \\[1\\]"):
        OscarCache(config(), "oscar-int2", rotations=RotationSet.hadamard(16, [0]))
    with pytest.raises(ValueError, match="extra \\[5\\]"):
        OscarCache(config(), "oscar-int2", rotations=RotationSet.hadamard(16, [0, 1, 5]))


def test_calibrated_method_without_rotations():
    with pytest.raises(ValueError, match="uses calibrated rotations"):
        OscarCache(config(), "oscar-int2")


def test_unsupported_bits():
    with pytest.raises(ValueError, match="unsupported bit width 5"):
        OscarCache(config(), OscarConfig(key=TensorQuantConfig(5), rotation="identity"))
    with pytest.raises(ValueError, match="both be quantized"):
        OscarCache(config(), OscarConfig(key=None, rotation="identity"))


@pytest.mark.parametrize(
    "field, message", [("sink", "sink must be a non-negative"), ("recent", "recent must be at least 1")]
)
def test_negative_windows(field, message):
    with pytest.raises(ValueError, match=message):
        OscarCache(config(), "naive-int2", **{field: -1})
    with pytest.raises(ValueError, match="block must be a positive"):
        OscarCache(config(), "naive-int2", block=0)


def test_bad_group_size_and_clip():
    with pytest.raises(ValueError, match="group_size 5"):
        OscarCache(config(), OscarConfig(key=TensorQuantConfig(group_size=5), rotation="identity"))
    with pytest.raises(ValueError, match="group_size 4 .* multiple of 8"):  # 3-bit groups: whole 1-bit-plane bytes
        OscarCache(config(), OscarConfig(key=TensorQuantConfig(3, group_size=4), rotation="identity"))
    with pytest.raises(ValueError, match="clip_ratio"):
        OscarCache(config(), OscarConfig(value=TensorQuantConfig(clip_ratio=1.5), rotation="identity"))


@pytest.mark.parametrize("method", ["quarot-int2", "int4"])
def test_non_power_of_two_head_dim_with_a_hadamard_method(method):
    with pytest.raises(ValueError, match="power-of-two head_dim.*head_dim=24"):
        OscarCache(config(head_dim=24), method)
    OscarCache(config(head_dim=24), "naive-int2")  # identity-based methods are fine


def test_offloading_and_unknown_options_are_refused():
    with pytest.raises(ValueError, match="does not support offloading"):
        OscarCache(config(), "naive-int2", offloading=True)
    with pytest.raises(ValueError, match="unknown OscarCache option.*'sinks'"):
        OscarCache(config(), "naive-int2", sinks=4)


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        OscarCache(config(), "int3")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_states_raise_when_checked(tiny, bad):
    cache = OscarCache(tiny, "naive-int2", check_finite=True)
    layer = cache.layers[0]
    states = torch.randn(1, 2, 5, 16)
    states[0, 1, 3, 7] = bad
    with pytest.raises(ValueError, match="non-finite"):
        layer.update(states, torch.randn(1, 2, 5, 16))
    unchecked = OscarCache(tiny, "naive-int2").layers[0]
    unchecked.update(states, torch.randn(1, 2, 5, 16))  # off by default: no host sync per step


def test_non_finite_check_in_a_model(tiny):
    cache = OscarCache(tiny, "naive-int2", check_finite=True)
    with torch.no_grad():
        tiny.model.layers[0].self_attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite values .* key"):
        forward(tiny, torch.randint(3, 200, (1, 10)), cache)
