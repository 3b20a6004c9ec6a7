"""Fold the value rotations R_V into the model's ``v_proj`` and ``o_proj`` weights.

An :class:`~oscar_hf.core.cache.OscarCache` normally rotates every new value row, ``v @ R_V``, and maps
every attention output back, ``o_rot @ R_V^T``. Both products can be moved into the weights once,
because nothing non-linear sits between ``v_proj``, attention and ``o_proj`` along the head dim:

* ``v_proj``: each KV head's ``[D, hidden]`` row block ``W_v,h <- R_V^T · W_v,h`` and its bias
  ``b_h <- b_h · R_V``, so ``v_proj`` emits ``v · R_V`` (as the reference implementation,
  github.com/FutureMLS-Lab/OSCAR, applies R_V where V is written);
* ``o_proj``: each query head's ``[hidden, D]`` column block ``W_o[:, h] <- W_o[:, h] · R_V``, so
  ``o_proj`` consumes rotated attention outputs directly (the reference keeps an explicit
  ``o · R_V^T`` instead).

With per-KV-head rotations ``[H_kv, D, D]``, KV head ``h`` folds its own ``R_V^(h)`` and query head
``i`` the ``R_V`` of its KV head ``i // g``.

The absorbed model computes the same function as before with any cache; an ``OscarCache`` on it
stores V as given and skips both rotations. The config records the fingerprint of the folded R_V
(``ABSORBED_ATTRIBUTE``), so that ``OscarCache`` refuses methods that would treat the pre-rotated
values as plain ones, and the mark survives ``save_pretrained``/``from_pretrained``.

Example::

    rotations = load_rotations(path)
    absorb_value_rotations(model, rotations)
    cache = OscarCache(model, "oscar-int2", rotations=rotations)
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from oscar_hf.core.cache import ABSORBED_ATTRIBUTE
from oscar_hf.log import get_logger
from oscar_hf.model_info import full_attention_layer_ids, head_dim_of, kv_heads_of
from oscar_hf.rotations.rotation_set import RotationSet, per_query_head

logger = get_logger(__name__)

# Attribute names of fused projections whose V rows we do not know how to locate.
_FUSED_PROJECTIONS = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "qkv", "kv_proj", "kv_a_proj_with_mqa")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj") + _FUSED_PROJECTIONS
# Attributes that betray quantized or wrapped linear layers (FP8, bitsandbytes, GPTQ/AWQ, ...).
_QUANTIZATION_MARKERS = ("weight_scale", "weight_scale_inv", "input_scale", "quant_state", "SCB", "qweight", "qzeros")
_FOLDABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def absorb_value_rotations(model: PreTrainedModel, rotations: RotationSet) -> None:
    """Fold ``rotations.value`` into ``v_proj``/``o_proj`` in place and mark the model as absorbed.

    ``rotations.value`` must hold an R_V for exactly the full-attention layers that
    :class:`~oscar_hf.core.cache.OscarCache` quantizes (sliding-window and other layer types are left
    untouched): an ``OscarCache`` on an absorbed model skips the V rotation on all of its layers, so
    a partial fold would leave some layers storing un-rotated values as if they were rotated.
    R_K is not used (it cannot be folded: RoPE sits between ``k_proj`` and the rotation).

    The products are computed in float32 and cast back to each weight's dtype; in bf16 this rounds
    the weights once, so logits differ from the un-absorbed model at the bf16 noise level.

    Raises:
        ValueError: the model is already absorbed, is quantized, the rotations do not cover exactly
            the full-attention layers, or an attention layer has a layout that cannot be folded
            (fused qkv projection, missing ``v_proj``/``o_proj``, a norm on V, wrapped or quantized
            linears, head counts that do not match the config). Nothing is modified in that case.
    """
    text_config = model.config.get_text_config(decoder=True)
    previous = getattr(text_config, ABSORBED_ATTRIBUTE, None)
    if previous is not None:
        raise ValueError(
            f"this model already has value rotations folded into its weights (fingerprint {previous}); "
            "absorbing again would rotate V twice. Reload the original weights to absorb other rotations."
        )
    _refuse_quantized_model(model)
    head_dim = head_dim_of(text_config)
    layer_ids = _full_attention_layers(model.config)
    kv_heads = kv_heads_of(text_config)
    query_heads = text_config.num_attention_heads
    rotations.check_model(head_dim, layer_ids, kv_heads)
    modules = _attention_modules(model, layer_ids)
    # Validate every layer before touching any weight, so that a refusal leaves the model intact.
    for layer_id in layer_ids:
        _check_foldable(modules[layer_id], layer_id, head_dim, kv_heads, query_heads)
    with torch.no_grad():
        for layer_id in layer_ids:
            rotation = rotations.value[layer_id]
            _fold_into_value_projection(modules[layer_id].v_proj, rotation, kv_heads)
            _fold_into_output_projection(modules[layer_id].o_proj, rotation, query_heads)
    fingerprint = rotations.value_fingerprint()
    setattr(text_config, ABSORBED_ATTRIBUTE, fingerprint)
    logger.info("folded R_V into v_proj/o_proj of %d layers (fingerprint %s)", len(layer_ids), fingerprint)


def absorbed_fingerprint(model_or_config: PreTrainedModel | PretrainedConfig) -> str | None:
    """The fingerprint of the R_V folded into a model's weights, or ``None`` if it is not absorbed."""
    config = model_or_config.config if isinstance(model_or_config, PreTrainedModel) else model_or_config
    return getattr(config.get_text_config(decoder=True), ABSORBED_ATTRIBUTE, None)


# ------------------------------------------------------------------------------------ checks
def _refuse_quantized_model(model: PreTrainedModel) -> None:
    if getattr(model, "hf_quantizer", None) is not None or getattr(model.config, "quantization_config", None):
        raise ValueError(
            "cannot fold value rotations into a quantized model (quantization_config is set): fold them into "
            "the floating-point weights first, then quantize"
        )


def _full_attention_layers(config: PretrainedConfig) -> list[int]:
    """The layers OscarCache quantizes; refuses a model without any."""
    layer_ids = full_attention_layer_ids(config)
    if not layer_ids:
        raise ValueError("this model has no full-attention layers: there is no value rotation to fold")
    return layer_ids


def _attention_modules(model: PreTrainedModel, layer_ids: list[int]) -> dict[int, nn.Module]:
    """The text decoder's attention module of each layer, recognised by ``layer_idx`` plus projections."""
    # Search the text decoder only: vision towers have attention modules with layer_idx too.
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None:
        decoder = model
    found: dict[int, list[str]] = {}
    modules: dict[int, nn.Module] = {}
    for name, module in decoder.named_modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int) and any(hasattr(module, p) for p in _PROJECTIONS):
            found.setdefault(layer_idx, []).append(name)
            modules[layer_idx] = module
    for layer_id in layer_ids:
        names = found.get(layer_id, [])
        if not names:
            raise ValueError(
                f"found no attention module for layer {layer_id} (a module with layer_idx={layer_id} and "
                "q/k/v/o projections): this architecture is not supported by absorption"
            )
        if len(names) > 1:
            raise ValueError(f"layer {layer_id} has several attention modules {names}; cannot tell which one to fold")
    return modules


def _check_foldable(module: nn.Module, layer_id: int, head_dim: int, kv_heads: int, query_heads: int) -> None:
    where = f"layer {layer_id} ({type(module).__name__})"
    fused = [p for p in _FUSED_PROJECTIONS if getattr(module, p, None) is not None]
    if fused:
        raise ValueError(
            f"{where} uses a fused projection ({fused[0]}): absorption only supports a separate v_proj and o_proj"
        )
    for name in ("v_proj", "o_proj"):
        if getattr(module, name, None) is None:
            raise ValueError(f"{where} has no {name}: this attention layout cannot be absorbed")
    if getattr(module, "v_norm", None) is not None:
        # A norm between v_proj and attention does not in general commute with R_V.
        raise ValueError(f"{where} normalises V after v_proj (v_norm): absorbing R_V would change its output")
    module_head_dim = getattr(module, "head_dim", head_dim)
    if module_head_dim != head_dim:
        raise ValueError(f"{where} has head_dim={module_head_dim} but the config says {head_dim}")
    _check_linear(module.v_proj, f"{where} v_proj", out_features=kv_heads * head_dim)
    _check_linear(module.o_proj, f"{where} o_proj", in_features=query_heads * head_dim)


def _check_linear(
    linear: nn.Module, where: str, out_features: int | None = None, in_features: int | None = None
) -> None:
    """Accept only a plain floating-point ``nn.Linear`` of the expected shape."""
    markers = [m for m in _QUANTIZATION_MARKERS if hasattr(linear, m) or hasattr(getattr(linear, "weight", None), m)]
    weight = getattr(linear, "weight", None)
    if not isinstance(linear, nn.Linear) or markers or type(weight) is not nn.Parameter:
        raise ValueError(
            f"{where} is a {type(linear).__name__} with weight {type(weight).__name__}: only a plain nn.Linear can be "
            "folded (merge adapters such as LoRA and fold before quantizing)"
        )
    if weight.dtype not in _FOLDABLE_DTYPES:
        raise ValueError(f"{where} has {weight.dtype} weights: only float32/float16/bfloat16 weights can be folded")
    if weight.device.type == "meta":
        raise ValueError(f"{where} has no materialised weights (meta device, e.g. offloaded): load them first")
    if out_features is not None and linear.out_features != out_features:
        raise ValueError(
            f"{where} has {linear.out_features} outputs, expected num_key_value_heads x head_dim = {out_features}"
        )
    if in_features is not None and linear.in_features != in_features:
        raise ValueError(
            f"{where} has {linear.in_features} inputs, expected num_attention_heads x head_dim = {in_features}"
        )


# ------------------------------------------------------------------------------------- folds
def _fold_into_value_projection(linear: nn.Linear, rotation: torch.Tensor, heads: int) -> None:
    """``W_v,h <- R_V^T · W_v,h`` and ``b_h <- b_h · R_V`` per KV head (its own R_V for a ``[H_kv, D, D]``
    rotation), so the layer emits ``v · R_V``."""
    dim = rotation.shape[-1]
    r = rotation.to(device=linear.weight.device, dtype=torch.float32)
    weight = linear.weight.float().reshape(heads, dim, linear.in_features)
    linear.weight.copy_((r.mT @ weight).reshape(linear.weight.shape))  # copy_ casts back to the weight dtype
    if linear.bias is not None:
        bias = linear.bias.float().reshape(heads, 1, dim)
        linear.bias.copy_((bias @ r).reshape(linear.bias.shape))


def _fold_into_output_projection(linear: nn.Linear, rotation: torch.Tensor, heads: int) -> None:
    """``W_o[:, h] <- W_o[:, h] · R_V`` per query head (its KV head's R_V for a ``[H_kv, D, D]`` rotation),
    so the layer takes ``o · R_V`` (its bias is unaffected)."""
    dim = rotation.shape[-1]
    r = per_query_head(rotation.to(device=linear.weight.device, dtype=torch.float32), heads)
    weight = linear.weight.float().reshape(linear.out_features, heads, 1, dim)
    linear.weight.copy_((weight @ r).reshape(linear.weight.shape))
