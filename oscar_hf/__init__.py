"""oscar-hf: OSCAR 2-bit KV-cache quantization for Hugging Face transformers.

Importing the package registers the ``"oscar"`` attention implementation.
"""

from oscar_hf.core import attention  # noqa: F401  (registers attn_implementation="oscar")
from oscar_hf.core.cache import OscarCache, OscarLayer
from oscar_hf.core.compat import cache_keyword
from oscar_hf.core.config import METHODS, OscarConfig, TensorQuantConfig
from oscar_hf.core.graph_generate import StaticDecoder, generate
from oscar_hf.core.memory import MemoryReport, bits_per_element
from oscar_hf.core.models import load_model
from oscar_hf.core.rotation_set import RotationSet

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "MemoryReport",
    "OscarCache",
    "OscarConfig",
    "OscarLayer",
    "RotationSet",
    "StaticDecoder",
    "TensorQuantConfig",
    "bits_per_element",
    "cache_keyword",
    "generate",
    "load_model",
]
