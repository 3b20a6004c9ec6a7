"""oscar-hf: OSCAR 2-bit KV-cache quantization for Hugging Face transformers.

Importing the package registers the ``"oscar"`` attention implementation.
"""

from . import attention  # noqa: F401  (registers attn_implementation="oscar")
from .cache import OscarCache, OscarLayer
from .compat import cache_keyword
from .config import METHODS, OscarConfig, TensorQuantConfig
from .generation import StaticDecoder, generate
from .memory import MemoryReport, bits_per_element
from .models import load_model
from .rotations import RotationSet

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
