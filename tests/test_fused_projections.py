"""Sibling projections (q/k/v, gate/up) as one GEMM: same outputs, fewer GEMMs, weights restored."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oscar_hf.core.fused_projections import StackedProjection, fused_projections, sibling_groups
from tests.conftest import tiny_model


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _logits_and_matmuls(model, ids):
    with torch.no_grad(), CountMatmuls() as counter:
        logits = model(ids).logits
    return logits, counter.count


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_same_logits_with_three_fewer_gemms_a_layer(arch):
    model = tiny_model(arch, attn="sdpa", attention_bias=True) if arch == "llama" else tiny_model(arch, attn="sdpa")
    ids = torch.randint(3, 256, (2, 9))
    want, plain = _logits_and_matmuls(model, ids)
    with fused_projections(model) as stacked:
        assert len(stacked) == 2 * model.config.num_hidden_layers  # attention and MLP of every layer
        got, fused = _logits_and_matmuls(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert plain - fused == 3 * model.config.num_hidden_layers  # q/k/v: 3 -> 1, gate/up: 2 -> 1


def test_weights_are_views_meanwhile_and_their_own_afterwards():
    model = tiny_model("qwen3")
    before = {name: p.clone() for name, p in model.named_parameters()}
    keys = set(model.state_dict())
    attention = model.model.layers[0].self_attn
    with fused_projections(model):
        stacked = next(m for m in attention.children() if isinstance(m, StackedProjection))
        base = stacked.weight.untyped_storage().data_ptr()
        assert all(p.weight.untyped_storage().data_ptr() == base for p in (attention.q_proj, attention.k_proj))
        assert set(model.state_dict()) == keys  # the stacked weights are non-persistent buffers
    assert not any(isinstance(m, StackedProjection) for m in model.modules())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert attention.q_proj.weight.untyped_storage().data_ptr() != attention.k_proj.weight.untyped_storage().data_ptr()
    assert "forward" not in attention.q_proj.__dict__


def test_a_sibling_called_on_another_input_computes_its_own_product():
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    x, y = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    with torch.no_grad(), fused_projections(model):
        q = attention.q_proj(x)
        k = attention.k_proj(y)  # not the input q saw: no slice of q's GEMM
        v = attention.v_proj(y)
    torch.testing.assert_close(q, x @ attention.q_proj.weight.T)
    torch.testing.assert_close(k, y @ attention.k_proj.weight.T)
    torch.testing.assert_close(v, y @ attention.v_proj.weight.T)


def test_hooked_or_mismatched_siblings_are_left_alone():
    model = tiny_model("llama")
    layers = model.model.layers
    layers[0].self_attn.k_proj.register_forward_hook(lambda *args: None)
    layers[1].mlp.up_proj = torch.nn.Linear(64, 128, bias=True)  # gate has no bias: not stackable
    groups = {(id(module), len(linears)) for module, _, linears in sibling_groups(model)}
    assert (id(layers[0].self_attn), 3) not in groups and (id(layers[1].mlp), 2) not in groups
    assert (id(layers[1].self_attn), 3) in groups and (id(layers[0].mlp), 2) in groups


class _Shard(torch.Tensor):
    """Stands for a tensor subclass weight (a tensor-parallel shard, a quantized weight)."""


def test_tensor_subclass_weights_are_not_stacked():
    model = tiny_model("llama", num_hidden_layers=1)
    v_proj = model.model.layers[0].self_attn.v_proj
    v_proj.weight = torch.nn.Parameter(v_proj.weight.detach().as_subclass(_Shard), requires_grad=False)
    assert [len(linears) for _, _, linears in sibling_groups(model)] == [2]  # the MLP's gate/up only
