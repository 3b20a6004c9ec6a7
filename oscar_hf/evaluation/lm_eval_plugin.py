"""Lets the stock ``lm_eval --model oscar ...`` command find the ``oscar`` model.

lm-eval 0.4.x discovers models only through its own registry: it has no entry-point group for
third-party models. The installed ``oscar_hf_lm_eval.pth`` runs :func:`install` at interpreter
start-up. That adds a finder which waits for ``lm_eval.models`` to be imported and then registers
``oscar`` as a lazy placeholder, so the process imports torch and oscar_hf only when an
evaluation actually asks for the ``oscar`` model.

This module must stay standard-library only and must not import the ``oscar_hf`` package: the
``.pth`` file loads it by path in every Python process of the environment.
"""

from __future__ import annotations

import importlib.abc
import sys

MODEL_NAME = "oscar"
MODEL_TARGET = "oscar_hf.evaluation.lm_eval_model:OscarLM"
_WATCHED_MODULE = "lm_eval.models"


def register_placeholder() -> None:
    """Register ``oscar`` in lm-eval's model registry without importing the model's module."""
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)


def _find_with_other_finders(fullname, path, target):
    for finder in sys.meta_path:
        spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
        if spec is not None:
            return spec
    return None


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``lm_eval.models`` so the placeholder is registered right after it runs."""

    registers = MODEL_TARGET  # how install() recognises a finder made by another copy of this module

    def find_spec(self, fullname, path, target=None):
        if fullname != _WATCHED_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = _find_with_other_finders(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            try:
                register_placeholder()
            except Exception:  # noqa: BLE001  (never break lm-eval because of us)
                pass

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Arrange for ``oscar`` to be registered whenever lm-eval's models are imported."""
    if _WATCHED_MODULE in sys.modules:
        register_placeholder()
    elif not any(getattr(finder, "registers", None) == MODEL_TARGET for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
