"""oscar-hf: OSCAR 2-bit KV-cache quantization for Hugging Face transformers.

Importing the package registers the ``"oscar"`` attention implementation. Everything a user needs is
importable from here::

    from oscar_hf import OscarCache, load_model, cache_keyword
    model, tokenizer = load_model("default")
    cache = OscarCache.from_zoo(model)
    model.generate(**inputs, **{cache_keyword(model): cache})
"""

from oscar_hf._version import __version__
from oscar_hf.calibration.absorption import absorb_value_rotations
from oscar_hf.calibration.recipe import Calibration, Recipe, calibrate
from oscar_hf.calibration.teacher_forcing import teacher_forced_logits
from oscar_hf.config import METHODS, OscarConfig, TensorQuantConfig
from oscar_hf.core import attention  # noqa: F401  (registers attn_implementation="oscar")
from oscar_hf.core.cache import OscarCache
from oscar_hf.core.compat import cache_keyword
from oscar_hf.core.graph_generate import generate
from oscar_hf.core.layer import OscarLayer
from oscar_hf.core.memory import MemoryReport, bits_per_element
from oscar_hf.core.models import load_model
from oscar_hf.core.step_guard import CacheBrokenError
from oscar_hf.core.step_replay import StaticDecoder
from oscar_hf.core.step_reuse import release_captured_steps
from oscar_hf.rotations.files import save_rotations
from oscar_hf.rotations.hub import load_rotations, push_rotations_to_hub
from oscar_hf.rotations.official import convert_official, load_official
from oscar_hf.rotations.resolve import resolve_rotations
from oscar_hf.rotations.rotation_set import RotationSet

__all__ = [
    "CacheBrokenError",
    "METHODS",
    "MemoryReport",
    "OscarCache",
    "OscarConfig",
    "OscarLayer",
    "RotationSet",
    "Calibration",
    "Recipe",
    "StaticDecoder",
    "TensorQuantConfig",
    "__version__",
    "absorb_value_rotations",
    "bits_per_element",
    "cache_keyword",
    "calibrate",
    "convert_official",
    "generate",
    "load_model",
    "load_official",
    "load_rotations",
    "push_rotations_to_hub",
    "release_captured_steps",
    "resolve_rotations",
    "save_rotations",
    "teacher_forced_logits",
]
