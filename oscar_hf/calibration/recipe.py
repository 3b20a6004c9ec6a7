"""One calibration function: a :class:`Recipe` (validated once) and :func:`calibrate`, which fits a model's
rotations (and clip ratios, and per-layer bit widths) on calibration files and returns them with the
metadata a saved set records. ``oscar-hf calibrate`` is a thin command line over it.

Example::

    recipe = Recipe(allocate_bits=6)  # the bundled oscar-int2 set's recipe
    result = calibrate(model, tokenizer, ["book1.txt", "prompts.jsonl"], recipe)
    result.save("my-rotations")
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from oscar_hf.calibration.bit_allocation import BitAllocation, allocate_bits, value_layers_per_key_layer
from oscar_hf.calibration.clip_search import LayerChoice, search_key_clips, search_layers
from oscar_hf.calibration.covariances import LayerCovariances, collect_covariances, rotations_from_covariances
from oscar_hf.calibration.data import CalibrationTexts, calibration_batches, read_calibration_files
from oscar_hf.calibration.key_feedback import DAMPING, key_feedback_factors
from oscar_hf.calibration.record import calibration_summary, existing_set, file_hashes
from oscar_hf.calibration.refine import refine_rotations
from oscar_hf.config import K_CLIP, METHODS, V_CLIP, OscarConfig
from oscar_hf.provenance import provenance
from oscar_hf.rotations.rotation_set import COMPOSITION_NAMES, RotationSet

# Calibration rows the clip search measures errors on (~20 s each on the default model, CPU).
SEARCH_ROWS = 2
# Rows the bit allocation scores its teacher-forced KL on: a layer's gain is a few 1e-4 nats, which two
# rows of 2048 tokens cannot tell from noise (4 rows: 4 x 92 passes of ~9 s on CPU with 3- and 4-bit keys).
ALLOCATION_ROWS = 4
OBJECTIVES = ("qqt_sst", "ktk_vtv")


@dataclass(frozen=True)
class Recipe:
    """How a rotation set is made. The defaults are the bundled ``oscar-int2`` set's recipe without the bit
    allocation (clip search, centered keys); ``clip_search=False`` is the paper's (``oscar-int2-paper``).

    Args:
        clip_search: choose each layer's clip ratios and rotation variant (U·H·P or H·P) by the
            attention-output error.
        refine: after the clip search, fit each R_K / R_V on the orthogonal group to the quantized
            attention-output error and search its clip ratio again (slower).
        per_head: one rotation per KV head, from that head's own C_Q and C_S.
        center_keys: store every key centered on its layer's and KV head's calibration mean (softmax
            ignores the common shift of a query's scores; the quantizer gets a smaller range). ``None``
            centers them with the clip search and leaves them uncentered for the paper's recipe
            (``clip_search=False``), ``refine`` (it fits rotations to uncentered keys) and ``from_rotations``
            (it keeps the saved set's means); the recipe records the resolved value.
        objective, factors: the covariances and the composition of plain rotations (without the clip search).
        allocate_bits: after the clip search, the bits of 4-bit keys in this many layers spent on keys of the
            ``allocate_key_bits`` widths where they cut the calibration KL most, and 1-bit values where they
            cost least, at ``allocate_for``'s history bits (:mod:`oscar_hf.calibration.bit_allocation`), scored
            with the key feedback factors and key clips the set will carry.
        allocate_key_bits: the key widths the allocation may give, of those above ``allocate_for``'s (3 and/or 4).
        allocate_for: the method the allocation trades against (``oscar-int2`` or ``oscar-k3v2``).
        search_for: the calibrated method whose quantization the clip search (and refinement) measures
            errors under, e.g. ``oscar-k3v2`` for a set made for 3-bit keys.
        from_rotations: a saved set to take rotations and clip ratios from (with ``allocate_bits`` or
            ``key_feedback``).
        key_feedback: store each layer's key feedback factors (:mod:`oscar_hf.calibration.key_feedback`), from
            the queries of the calibration texts in rows of ``feedback_seq_len`` tokens (the budget rounded up
            to whole rows, at most the model's context). ``None``: on with the clip search, off for the paper's
            recipe.
        tokens, seq_len, seed, chat: the calibration token budget, row length, sampling seed, and whether
            ``.jsonl`` prompts are rendered with the chat template.

    Raises:
        ValueError: a combination that cannot be made (each message names the command line's flag too).
    """

    clip_search: bool = True
    refine: bool = False
    per_head: bool = False
    center_keys: bool | None = None
    objective: str = "qqt_sst"
    factors: str = "UHP"
    allocate_bits: int = 0
    allocate_key_bits: tuple[int, ...] = (3, 4)
    allocate_for: str = "oscar-int2"
    search_for: str = "oscar-int2"
    from_rotations: str | None = None
    key_feedback: bool | None = None
    feedback_seq_len: int = 8192
    tokens: int = 20000
    seq_len: int = 2048
    seed: int = 0
    chat: bool = False

    def __post_init__(self) -> None:
        if self.center_keys is None:
            centered = self.clip_search and not self.refine and not self.from_rotations
            object.__setattr__(self, "center_keys", centered)
        if self.key_feedback is None:
            object.__setattr__(self, "key_feedback", self.clip_search)
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, not {self.objective!r}")
        if self.factors not in COMPOSITION_NAMES:
            raise ValueError(f"factors must be one of {sorted(COMPOSITION_NAMES)}, not {self.factors!r}")
        if min(self.tokens, self.seq_len, self.feedback_seq_len) < 1 or self.allocate_bits < 0:
            raise ValueError("tokens, seq_len and feedback_seq_len must be positive and allocate_bits not negative")
        if self.clip_search and (self.objective != "qqt_sst" or self.factors != "UHP"):
            raise ValueError(
                "the clip search chooses between U·H·P and H·P itself: set clip_search=False (--no-clip-search) "
                "to pick the objective and factors"
            )
        needs_search = {"refine": self.refine, "allocate_bits": self.allocate_bits}
        for name in (name for name, value in needs_search.items() if value and not self.clip_search):
            raise ValueError(
                f"{name} starts from the clip search's rotations and ratios: keep clip_search=True "
                "(drop --no-clip-search)"
            )
        if self.from_rotations and not (self.allocate_bits or self.key_feedback):
            raise ValueError(
                "from_rotations takes a saved set's rotations and clip ratios to allocate bit widths anew or to add "
                "key feedback: set allocate_bits or key_feedback (add --allocate-bits N or --key-feedback)"
            )
        if self.from_rotations and (self.refine or self.per_head or self.center_keys):
            raise ValueError(
                "from_rotations keeps the saved set's rotations: drop refine, per_head and center_keys "
                "(--refine, --per-head, --center-keys)"
            )
        if self.refine and self.center_keys:
            raise ValueError(
                "refine fits rotations to uncentered keys: drop refine or center_keys (--refine, --center-keys)"
            )
        if self.allocate_for not in METHODS:
            raise ValueError(f"allocate_for must be one of {sorted(METHODS)}, not {self.allocate_for!r}")
        if self.allocate_for != "oscar-int2":
            if not self.allocate_bits:
                raise ValueError(
                    "allocate_for names the method a bit allocation is for: set allocate_bits (add --allocate-bits N)"
                )
            value_layers_per_key_layer(METHODS[self.allocate_for])  # raises for a method it cannot allocate for
        object.__setattr__(self, "allocate_key_bits", tuple(sorted(set(self.allocate_key_bits))))
        base_key_bits = METHODS[self.allocate_for].key.bits
        if not set(self.allocate_key_bits) <= {3, 4} or not any(b > base_key_bits for b in self.allocate_key_bits):
            raise ValueError(
                f"allocate_key_bits takes 3 and/or 4, at least one above {self.allocate_for}'s {base_key_bits}-bit "
                f"keys; got {list(self.allocate_key_bits)}"
            )
        searched = METHODS.get(self.search_for)
        if searched is None or not (searched.quantized and searched.rotation == "calibrated"):
            calibrated = sorted(name for name, config in METHODS.items() if config.rotation == "calibrated")
            raise ValueError(f"search_for must be one of {calibrated}, not {self.search_for!r}")
        if self.search_for != "oscar-int2" and not self.clip_search:
            raise ValueError(
                "search_for names the method the clip search measures under: keep clip_search=True "
                "(drop --no-clip-search)"
            )

    def to_dict(self) -> dict:
        """The fields as JSON holds them, ``from_rotations`` by folder name (a saved set records no path of this
        machine)."""
        fields = {**dataclasses.asdict(self), "allocate_key_bits": list(self.allocate_key_bits)}
        if self.from_rotations:
            fields["from_rotations"] = Path(self.from_rotations).name
        return fields


@dataclass
class Calibration:
    """What :func:`calibrate` made: the rotations, the metadata a saved set records (recipe, data by file
    name and hash, model, provenance) and a summary (time, memory, per-layer choices)."""

    rotations: RotationSet
    metadata: dict
    summary: dict

    def save(self, out: str | Path) -> Path:
        """Write the set to ``out`` (:func:`oscar_hf.rotations.files.save_rotations`); returns the folder."""
        from oscar_hf.rotations.files import save_rotations

        return save_rotations(self.rotations, out, self.metadata)


def calibrate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: Sequence[str | Path],
    recipe: Recipe = Recipe(),
    model_id: str | None = None,
    command: str | None = None,
    progress: bool = True,
) -> Calibration:
    """Fit ``model``'s rotations to the calibration files ``data`` (``.txt`` documents, ``.jsonl`` prompts or
    chats, read in place) as ``recipe`` says. ``model_id`` (default: the model's name) and ``command``
    (default: this call) are what the metadata records."""
    from oscar_hf.rotations.resolve import model_signature

    started = time.perf_counter()
    files = [Path(p) for p in data]
    texts = read_calibration_files(files, tokenizer, chat=recipe.chat)
    batches = calibration_batches(tokenizer, texts, recipe.tokens, recipe.seq_len, recipe.seed)
    covariances: dict[int, LayerCovariances] = {}
    choices: dict[int, LayerChoice] = {}
    if recipe.from_rotations:
        rotations, made = existing_set(recipe.from_rotations)
    else:
        covariances = collect_covariances(model, batches, progress=progress)
        rotations, choices = fit(recipe, model, batches, covariances, progress=progress)
        made = _how_made(recipe, rotations, choices)
    rows = feedback_batches(model, tokenizer, texts, recipe) if recipe.key_feedback else None
    rotations, allocation, feedback = finish(recipe, model, batches, rotations, rows, progress)
    tokens = sum(b.numel() for b in batches)
    # the windows the clip search and bit allocation ran with: a cache takes them with the set
    windows = (METHODS[recipe.search_for].sink, METHODS[recipe.search_for].recent)
    rotations = dataclasses.replace(rotations, windows=windows)
    metadata = {
        "model_id": model_id or model.config._name_or_path,
        "model_signature": model_signature(model),
        **made,
        "recipe": recipe.to_dict(),
        "group_size": rotations.head_dim,
        "calibration_data": {
            "files": file_hashes(files),
            "documents": len(texts.documents),
            "prompts": len(texts.prompts),
            "chat_template": recipe.chat,
            "seq_len": recipe.seq_len,
            "rows": len(batches),
            "seed": recipe.seed,
            **({"key_feedback": feedback} if feedback else {}),
        },
        "tokens": tokens,
        **provenance(command or f"oscar_hf.calibrate(model, tokenizer, data, {recipe!r})"),
    }
    if allocation is not None:
        metadata["bit_allocation"] = allocation.to_dict()
    summary = calibration_summary(started, tokens, covariances, rotations, choices, allocation, recipe.allocate_for)
    return Calibration(rotations, metadata, summary)


def fit(
    recipe: Recipe,
    model: PreTrainedModel,
    batches: list[torch.Tensor],
    covariances: dict[int, LayerCovariances],
    progress: bool = True,
    config: OscarConfig | None = None,
) -> tuple[RotationSet, dict[int, LayerChoice]]:
    """The rotations (and clip ratios) ``recipe`` makes from ``covariances`` and calibration rows ``batches``,
    with the clip search's choices, measured under ``recipe.search_for``'s quantization (``config``: that
    method with other windows or groups, as an ablation varies them)."""
    if not recipe.clip_search:
        rotations = rotations_from_covariances(covariances, recipe.objective, recipe.factors, recipe.per_head)
        if recipe.center_keys:
            rotations = dataclasses.replace(
                rotations, key_mean={i: c.key_mean_heads.float() for i, c in covariances.items()}
            )
        return rotations, {}
    config = config or METHODS[recipe.search_for]
    rows = _search_rows(batches, config)
    rotations, choices = search_layers(
        model, rows, covariances, config, progress=progress, per_head=recipe.per_head, center_keys=recipe.center_keys
    )
    if recipe.refine:  # refinement stacks its rows, so they must be equally long
        rows = [r for r in rows if r.shape[1] == rows[0].shape[1]]
        rotations, _ = refine_rotations(model, rows, rotations, config=config, progress=progress)
    return rotations, choices


def finish(
    recipe: Recipe,
    model: PreTrainedModel,
    batches: list[torch.Tensor],
    rotations: RotationSet,
    feedback_rows: list[torch.Tensor] | None,
    progress: bool = True,
    config: OscarConfig | None = None,
) -> tuple[RotationSet, BitAllocation | None, dict]:
    """The stages after the rotations: with ``recipe.key_feedback``, :func:`feed_back_keys`; then the bit
    allocation, scored with the factors and key clips the set will carry. Returns the set, the allocation
    (or None) and how the factors were made (empty without them)."""
    made: dict = {}
    if recipe.key_feedback:
        rotations, made = feed_back_keys(recipe, model, batches, rotations, feedback_rows, progress, config)
    rotations, allocation = allocate(recipe, model, batches, rotations, progress=progress)
    return rotations, allocation, made


def feed_back_keys(
    recipe: Recipe,
    model: PreTrainedModel,
    batches: list[torch.Tensor],
    rotations: RotationSet,
    feedback_rows: list[torch.Tensor] | None,
    progress: bool = True,
    config: OscarConfig | None = None,
) -> tuple[RotationSet, dict]:
    """The key feedback stage: the factors from the queries of ``feedback_rows`` (:func:`feedback_batches`)
    and, with the clip search, each layer's key clip ratio chosen again under them on ``batches`` (measured
    under ``config``, as :func:`fit`). Returns the set and how it was made."""
    if not feedback_rows:
        raise ValueError("a recipe with key feedback needs its rows (feedback_batches)")
    factors = key_feedback_factors(model, feedback_rows, rotations, progress=progress)
    length = feedback_rows[0].shape[1]
    described = rotations.description.split("; key feedback")[0] + f"; key feedback from C_Q on rows of {length} tokens"
    rotations = dataclasses.replace(rotations, key_feedback=factors, description=described)
    tokens = sum(r.numel() for r in feedback_rows)
    made = {"seq_len": length, "rows": len(feedback_rows), "tokens": tokens, "damping": DAMPING}
    if recipe.clip_search:
        config = config or METHODS[recipe.search_for]
        rotations, _ = search_key_clips(model, _search_rows(batches, config), rotations, config, progress=progress)
        made["key_clip"] = {str(i): ratio for i, ratio in sorted(rotations.key_clip.items())}
    return rotations, made


def allocate(
    recipe: Recipe, model: PreTrainedModel, batches: list[torch.Tensor], rotations: RotationSet, progress: bool = True
) -> tuple[RotationSet, BitAllocation | None]:
    """``rotations`` with the per-layer bit widths ``recipe.allocate_bits`` asks for (for ``recipe.allocate_for``),
    chosen on the calibration rows ``batches``, and the allocation; unchanged and None without one."""
    if not recipe.allocate_bits:
        return rotations, None
    method = METHODS[recipe.allocate_for]
    return allocate_bits(
        model,
        _search_rows(batches, count=ALLOCATION_ROWS),
        rotations,
        recipe.allocate_bits,
        method,
        recipe.allocate_key_bits,
        progress,
    )


def feedback_batches(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: CalibrationTexts, recipe: Recipe
) -> list[torch.Tensor]:
    """The rows the key feedback factors are measured on (:func:`feedback_shape`)."""
    rows, length = feedback_shape(model, recipe)
    return calibration_batches(tokenizer, texts, rows * length, length, recipe.seed)


def feedback_shape(model: PreTrainedModel, recipe: Recipe) -> tuple[int, int]:
    """``(rows, tokens a row)`` of the key feedback's pass: ``recipe.feedback_seq_len`` tokens a row (at most
    the model's context), the token budget rounded up to whole rows."""
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    length = min(recipe.feedback_seq_len, context or recipe.feedback_seq_len)
    return -(-recipe.tokens // length), length


def _how_made(recipe: Recipe, rotations: RotationSet, choices: dict[int, LayerChoice]) -> dict:
    """The metadata that says how the rotations and clip ratios were made."""
    made = {
        "objective": recipe.objective,
        "composition": _composition(recipe),
        "source_grouping": "per_kv_head" if recipe.per_head else "layer",
        "clip": "per-layer (clip search)" if recipe.clip_search else {"key": K_CLIP, "value": V_CLIP},
    }
    if choices:
        made["layer_choices"] = {
            str(i): {
                "key": f"{c.key_factors}@{rotations.key_clip[i]}",
                "value": f"{c.value_factors}@{rotations.value_clip[i]}",
            }
            for i, c in choices.items()
        }
    return made


def _composition(recipe: Recipe) -> str:
    if not recipe.clip_search:
        return COMPOSITION_NAMES[recipe.factors]
    chosen = "per-layer r_h_pbr or h_pbr (clip search)"
    return chosen + " refined on the orthogonal group" if recipe.refine else chosen


def _search_rows(
    batches: list[torch.Tensor], config: OscarConfig = METHODS["oscar-int2"], count: int = SEARCH_ROWS
) -> list[torch.Tensor]:
    """The ``count`` longest rows: the search needs keys old enough to have left the BF16 window."""
    needed = config.sink + config.recent + config.block
    rows = sorted(batches, key=lambda b: b.shape[1], reverse=True)[:count]
    if rows[0].shape[1] <= needed:
        raise ValueError(
            f"the clip search needs calibration rows longer than {needed} tokens (sink + recent window); the longest "
            f"has {rows[0].shape[1]}. Add document (.txt) data or raise seq_len (--seq-len)."
        )
    return [r for r in rows if r.shape[1] > needed]
