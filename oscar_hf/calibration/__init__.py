"""Calibration: what fits rotations to a model with the cache (covariances, clip search, refinement,
bit allocation, teacher forcing) and folds R_V into its weights (absorption).

Builds on :mod:`oscar_hf.core` and :mod:`oscar_hf.rotations`; imports nothing from
:mod:`oscar_hf.evaluation` or :mod:`oscar_hf.cli`.
"""
