"""What the cache needs to know about a model: its text config, head_dim, KV heads, which layers are
full attention, and its tensor-parallel rank. Every module asks here, so each rule exists once."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

# The attention implementation OscarCache registers, which reads the packed history directly.
ATTENTION_NAME = "oscar"


def text_config_of(model: PreTrainedModel | PretrainedConfig) -> PretrainedConfig:
    """The decoder's config of a model or of a (possibly multimodal) config."""
    config = model.config if isinstance(model, PreTrainedModel) else model
    return config.get_text_config(decoder=True)


def head_dim_of(model: PreTrainedModel | PretrainedConfig) -> int:
    """The attention head size (``head_dim``, else ``hidden_size / num_attention_heads``)."""
    text = text_config_of(model)
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def kv_heads_of(model: PreTrainedModel | PretrainedConfig) -> int:
    """The model's KV head count (all ranks together under tensor parallelism)."""
    text = text_config_of(model)
    return getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def full_attention_layer_ids(model: PreTrainedModel | PretrainedConfig) -> list[int]:
    """The layers OscarCache quantizes: those for which transformers' own ``DynamicCache`` keeps a plain
    full-length ``DynamicLayer`` (sliding-window, chunked and linear-attention layers keep their own)."""
    config = model.config if isinstance(model, PreTrainedModel) else model
    return [i for i, layer in enumerate(DynamicCache(config=config).layers) if type(layer) is DynamicLayer]


def tensor_parallel_rank(model: PreTrainedModel) -> tuple[int, int] | None:
    """(rank, size) of a model sharded by transformers' tensor parallelism (``tp_plan="auto"``), else None."""
    size = getattr(model, "tp_size", None)
    if not size or size == 1:
        return None
    manager = getattr(model, "_mesh_manager", None)  # transformers keeps the TP mesh there
    if manager is not None:
        return manager.get_mesh("tp").get_local_rank(), size
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() == size:
        return torch.distributed.get_rank(), size
    raise ValueError(f"cannot tell this process's rank in the model's tensor-parallel group of {size}")
