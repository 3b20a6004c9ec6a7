"""Random-weight Qwen3 models at real shapes, their random rotations and prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedModel, Qwen3Config

from oscar_hf import RotationSet
from oscar_hf.model_info import full_attention_layer_ids, head_dim_of, text_config_of

from .cases import free_memory, guarded

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Qwen3 shapes from the models' config.json, with room for 128K positions (weights are random).
MODEL_PRESETS: dict[str, dict] = {
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=135168,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        max_position_embeddings=135168,
    ),
}


def model_spec(entry: str | dict) -> tuple[str, dict]:
    """``(name, Qwen3Config kwargs)`` from a preset name or a dict (``{"preset": ..., **overrides}``)."""
    if isinstance(entry, str):
        return entry, dict(MODEL_PRESETS[entry])
    entry = dict(entry)
    preset = entry.pop("preset", None)
    name = entry.pop("name", preset or "custom")
    return name, {**MODEL_PRESETS.get(preset, {}), **entry}


def add_model_arguments(parser, several_batches: bool = False) -> None:
    """``--model`` (a preset or a JSON object), ``--device``, ``--context``, ``--batch`` (with
    ``several_batches``, one or more), ``--out``: the options of the single-model diagnostics
    (``eval/step_times.py``, ``eval/profile_decode.py``, ``eval/host_time.py``)."""
    parser.add_argument(
        "--model",
        default="qwen3-8b",
        type=lambda text: model_spec(json.loads(text) if text.startswith("{") else text),
        help="a preset (MODEL_PRESETS) or a JSON object",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=100_000)
    parser.add_argument(
        "--batch", type=int, default=[1] if several_batches else 1, nargs="+" if several_batches else None
    )
    parser.add_argument("--out", type=Path, default=Path("eval/results"))


def build_model(spec: dict, device: str | torch.device, dtype: torch.dtype, attn: str = "sdpa") -> PreTrainedModel:
    """A random-weight Qwen3 (normal, std 0.02) initialised directly on ``device`` in ``dtype``.

    Initialising billions of weights on the CPU takes minutes; on the GPU it takes seconds, and the
    speed of a forward pass does not depend on the values.
    """
    from transformers import Qwen3ForCausalLM

    config = Qwen3Config(**{"use_sliding_window": False, "pad_token_id": 0, **spec})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = 0
    model.set_attn_implementation(attn)
    return model


def save_random_model(spec: dict, path: Path, device: str | torch.device, dtype: torch.dtype) -> None:
    """Build a random-weight Qwen3 on ``device`` and save it (weights move to the CPU for writing)."""
    model = build_model(spec, device, dtype)
    model.save_pretrained(path)
    del model
    free_memory()


def model_cases(config: dict, run_model: Callable[[str, PreTrainedModel], list[dict]]) -> list[dict]:
    """Build each configured model in turn, run its cases, free it; a model that fails to build is a row."""
    rows = []
    device, dtype = config["device"], DTYPES[config["dtype"]]
    for entry in config["models"]:
        name, spec = model_spec(entry)
        holder: dict = {}
        row = guarded(
            {"model": name, "part": "build"}, lambda: holder.update(model=build_model(spec, device, dtype)) or {}
        )
        if "model" in holder:
            rows.extend(run_model(name, holder.pop("model")))
        else:
            rows.append(row)
        free_memory()
    return rows


def attention_device(model: PreTrainedModel, layer_idx: int) -> torch.device:
    """Where layer ``layer_idx``'s attention runs (with ``device_map`` layers live on different GPUs)."""
    return model.get_decoder().layers[layer_idx].self_attn.k_proj.weight.device


def input_device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


def random_tokens(model: PreTrainedModel, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, text_config_of(model).vocab_size, (batch, length), generator=generator)
    return ids.to(input_device(model))


def random_rotations(head_dim: int, layer_ids: list[int], seed: int = 0, kv_heads: int | None = None) -> RotationSet:
    """A random orthogonal R_K and R_V per layer (QR of a Gaussian matrix), standing in for calibrated ones;
    with ``kv_heads``, one per KV head (``[kv_heads, D, D]``).

    Speed does not depend on which orthogonal matrix it is, and ``oscar-int2`` with rotations runs
    exactly the code a calibrated model runs (rotate, clip at 0.96/0.92, quantize).
    """
    generator = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()

    def orthogonal() -> torch.Tensor:
        return one() if kv_heads is None else torch.stack([one() for _ in range(kv_heads)])

    return RotationSet(
        head_dim,
        {i: orthogonal() for i in layer_ids},
        {i: orthogonal() for i in layer_ids},
        "random orthogonal (benchmark)",
    )


def model_rotations(model: PreTrainedModel, config: dict) -> RotationSet:
    """The benchmark's rotations for ``model``: one per KV head when ``config["rotations"]`` is ``"per_kv_head"``."""
    kind = config.get("rotations", "per_kv_head")
    if kind not in ("per_kv_head", "per_layer"):
        raise ValueError(f"rotations must be 'per_kv_head' or 'per_layer', got {kind!r}")
    kv_heads = text_config_of(model).num_key_value_heads if kind == "per_kv_head" else None
    return random_rotations(head_dim_of(model), full_attention_layer_ids(model), config["seed"], kv_heads)
