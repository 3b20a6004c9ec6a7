"""The Triton and Gluon kernels with their torch references, kept in the repository's top-level ``kernels/``.

A wheel installs that folder as this package (pyproject.toml maps ``oscar_hf.kernels`` to ``kernels/``) and
leaves this file out. In a checkout and an editable install this file stands in for it: the package's
modules are looked up in ``kernels/`` (the package's own search path, as ``pkgutil`` namespaces set it).
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "kernels")]
