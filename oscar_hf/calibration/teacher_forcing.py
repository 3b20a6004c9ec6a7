"""Teacher-forced evaluation of a cache configuration in one forward pass.

Step-by-step decoding with an :class:`~oscar_hf.OscarCache` shows query ``i`` the keys
``[sink, sink + h(i))`` quantized (the history at that step) and every other key in high precision.
One forward pass with that per-(query, key) choice gives the same logits as the real schedule,
without running thousands of decode steps. Two schedules are covered:

* ``prefill=0``: every token is decoded one at a time from the first (perplexity and KL windows);
* ``prefill=P``: the first ``P`` tokens are prefilled in one chunk, which attends to its own
  unquantized K/V (then the middle of it goes to the history and the last ``recent`` tokens stay in
  high precision), and every later token is decoded against that cache (a prompt and its answer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from oscar_hf.config import OscarConfig
from oscar_hf.core.attention import swapped_attention
from oscar_hf.core.cache import OscarCache
from oscar_hf.core.compat import cache_keyword
from oscar_hf.core.layer import OscarLayer

TEACHER_FORCED = "oscar_teacher_forced"
_state: dict[str, object] = {}


def history_lengths(length: int, config: OscarConfig, prefill: int = 0) -> torch.Tensor:
    """h(i): tokens in the quantized history when query ``i`` attends (no padding).

    Queries of a ``prefill``-token first chunk attend before anything is quantized (h = 0). That chunk
    leaves ``h0 = prefill - sink - recent`` tokens in the history when its window part reaches
    ``recent + block`` tokens (none otherwise). Each decoded token then joins the recent window, which
    holds ``recent``..``recent + block - 1`` tokens including the new one and is demoted ``block`` at a
    time, so h jumps by ``block`` each time the window reaches ``recent + block``. ``prefill`` 0 or 1 is
    decoding from the first token.
    """
    if not config.quantized:
        return torch.zeros(length, dtype=torch.long)
    steps = torch.arange(length)
    window_after_prefill = prefill - config.sink
    start = window_after_prefill - config.recent if window_after_prefill >= config.recent + config.block else 0
    window = steps + 1 - config.sink - start  # the window's size if nothing had been demoted since the prefill
    demoted = config.block * torch.div(window - config.recent, config.block, rounding_mode="floor")
    history = start + torch.where(window >= config.recent + config.block, demoted, torch.zeros_like(demoted))
    return torch.where(steps < prefill, torch.zeros_like(history), history)


def quantized_key_mask(length: int, config: OscarConfig, device: torch.device, prefill: int = 0) -> torch.Tensor:
    """Boolean ``[query, key]``: whether query ``i`` sees key ``j`` through the quantized history."""
    keys = torch.arange(length, device=device)
    ends = config.sink + history_lengths(length, config, prefill).to(device)
    return (keys[None, :] >= config.sink) & (keys[None, :] < ends[:, None])


def _teacher_forced_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    cache: OscarCache = _state["cache"]
    prefill: int = _state["prefill"]
    layer = cache.layers[module.layer_idx]
    if not isinstance(layer, OscarLayer) or not layer.config.quantized:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if attention_mask is not None and attention_mask.dtype == torch.bool and not bool(attention_mask.any(-1).all()):
        raise ValueError("teacher-forced evaluation takes unpadded sequences")
    first = key.shape[2] - query.shape[2]  # tokens held by a cache passed in: the queries start there
    if first:
        if first < prefill:
            raise ValueError(f"a cache passed in must hold at least the {prefill} prefill tokens, it holds {first}")
        return _mixed_attention(layer, query, key, value, prefill, first, scaling), None
    outputs = []
    if prefill:
        # The prefill chunk attends to its own unquantized K/V, exactly as OscarCache's first chunk does.
        mask = None if attention_mask is None else attention_mask[..., :prefill, :prefill]
        prefilled, _ = sdpa_attention_forward(
            module, query[:, :, :prefill], key[:, :, :prefill], value[:, :, :prefill], mask, scaling=scaling, **kwargs
        )
        outputs.append(prefilled)
    outputs.append(_mixed_attention(layer, query[:, :, prefill:], key, value, prefill, prefill, scaling))
    return torch.cat(outputs, dim=1) if prefill else outputs[0], None


def _mixed_attention(
    layer: OscarLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefill: int,
    first: int,
    scaling: float | None,
) -> torch.Tensor:
    """``[B, n, Hq, D]`` attention of the decoded queries at ``first..`` over the quantized and high-precision keys."""
    keys_hp, values_hp = layer.store_keys(key), layer.rotate_values(value)
    keys_q, values_q = layer.history_roundtrip(keys_hp, values_hp)
    batch, q_heads, _, head_dim = query.shape
    length = key.shape[2]
    groups = q_heads // key.shape[1]
    # One fused softmax over two copies of every key: the quantized copy is visible to query i for the
    # keys in its history, the high-precision copy for every other causal key. Each (i, j) is counted
    # once, so this is exactly the mixed attention, without [T, T] score tensors per head.
    from_history = quantized_key_mask(length, layer.config, query.device, prefill)[first:]
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()[first:]
    mask = torch.cat([from_history, causal & ~from_history], dim=1)
    keys = torch.cat([keys_q, keys_hp], dim=2).float().repeat_interleave(groups, dim=1)
    values = torch.cat([values_q, values_hp], dim=2).float().repeat_interleave(groups, dim=1)
    output = torch.nn.functional.scaled_dot_product_attention(
        layer.rotate_keys(query).float(),
        keys,
        values,
        attn_mask=mask,
        scale=scaling if scaling is not None else head_dim**-0.5,
    )
    output = layer.unrotate_values(output.to(query.dtype))
    return output.transpose(1, 2).contiguous()


@contextlib.contextmanager
def _teacher_forced(model: PreTrainedModel, cache: OscarCache, prefill: int) -> Iterator[None]:
    _state.update(cache=cache, prefill=prefill)
    try:
        with swapped_attention(model, TEACHER_FORCED, _teacher_forced_attention):
            yield
    finally:
        _state.clear()
        for layer in cache.layers:  # one pass per cache: keep no rotations cast for it
            if isinstance(layer, OscarLayer):
                layer.drop_rotation_copies()


@torch.no_grad()
def teacher_forced_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: OscarCache,
    prefill: int = 0,
    logits_to_keep: int = 0,
    past_key_values: DynamicCache | None = None,
) -> torch.Tensor:
    """Logits ``[batch, length, vocab]`` that ``cache``'s configuration gives ``input_ids`` in real use.

    ``prefill`` 0: decoding token by token from the first; ``prefill`` P: the first P tokens are
    prefilled in one chunk and the rest decoded one at a time (the logits at ``P - 1`` predict the
    first decoded token). ``logits_to_keep`` N > 0 returns only the last N positions (the LM head
    over every position of a long prompt costs more memory than the rest of the pass).

    ``past_key_values``: a DynamicCache, which the pass fills with the unquantized K/V of
    ``input_ids``. Cropped back to the prefill (``crop(P - length)``) and passed with only the decoded
    tokens as ``input_ids``, it continues the same schedule without running the prefill again
    (e.g. to verify another continuation of one prompt). ``cache`` only supplies the configuration and
    rotations; it is not filled.
    """
    past = 0 if past_key_values is None else past_key_values.get_seq_length()
    if not 0 <= prefill < past + input_ids.shape[1]:
        raise ValueError(f"prefill must be in [0, {past + input_ids.shape[1]}), got {prefill}")
    with _teacher_forced(model, cache, prefill):
        past = {} if past_key_values is None else {cache_keyword(model): past_key_values}
        return model(input_ids, use_cache=past_key_values is not None, logits_to_keep=logits_to_keep, **past).logits


def window_starts(n_tokens: int, context: int, windows: int) -> list[int]:
    """Start of each of ``windows`` windows spread evenly: window k starts at k * floor((n - ctx) / (N - 1))."""
    if n_tokens < context:
        raise ValueError(f"the text has {n_tokens} tokens, fewer than one window of {context}")
    if windows < 1:
        raise ValueError("windows must be at least 1")
    stride = (n_tokens - context) // (windows - 1) if windows > 1 else 0
    return [k * stride for k in range(windows)]


def token_stats(
    logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor, chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: NLL of the target, KL(reference || logits) in nats, and top-1 agreement (0/1).

    ``logits`` and ``reference`` are ``[positions, vocab]`` logits, ``targets`` ``[positions]``. The
    float32 log-probabilities are taken ``chunk`` positions at a time: for a whole window over a large
    vocabulary they would take several times the memory of the model's own activations.
    """
    parts = []
    for start in range(0, targets.numel(), chunk):
        rows = slice(start, start + chunk)
        log_probs, expected = _log_probs(logits[rows]), _log_probs(reference[rows])
        nll = -log_probs.gather(-1, targets[rows, None])[:, 0]
        kl = (expected.exp() * (expected - log_probs)).sum(-1)
        agree = (log_probs.argmax(-1) == expected.argmax(-1)).float()
        parts.append((nll, kl, agree))
    nll, kl, agree = (torch.cat(column) for column in zip(*parts))
    return nll, kl, agree


@torch.no_grad()
def position_stats_of_caches(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    caches: dict[str, OscarCache],
    context: int,
    windows: int,
    progress: bool = True,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """``{label: [3, context - 1]}`` window-averaged NLL, KL from ``none`` and top-1 agreement per position.

    Position ``p`` predicts token ``p + 1``. Every window is decoded teacher-forced once unquantized
    (the reference) and once per quantizing cache; caches that quantize nothing reuse the reference.
    Also returns the window starts.
    """
    reference_cache = OscarCache(model, "none")
    starts = window_starts(token_ids.numel(), context, windows)
    sums = {label: torch.zeros(3, context - 1, dtype=torch.float64) for label in caches}
    device = next(model.parameters()).device
    bar = tqdm(
        total=len(starts) * (1 + sum(c.oscar_config.quantized for c in caches.values())),
        desc="teacher-forced passes",
        disable=not progress,
    )
    for start in starts:
        ids = token_ids[start : start + context][None].to(device)
        bar.set_postfix_str(f"window at {start}, none")
        reference = teacher_forced_logits(model, ids, reference_cache)[0, :-1]
        bar.update()
        for label, cache in caches.items():
            if cache.oscar_config.quantized:
                bar.set_postfix_str(f"window at {start}, {label}")
                logits = teacher_forced_logits(model, ids, cache)[0, :-1]
                bar.update()
            else:
                logits = reference
            sums[label] += torch.stack(token_stats(logits, reference, ids[0, 1:])).double().cpu()
            del logits
    bar.close()
    return {label: s / len(starts) for label, s in sums.items()}, starts


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(dim=-1)
