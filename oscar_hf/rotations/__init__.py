"""Rotations: their math, calibration (covariances, clip search, refinement, bit allocation), files
(our format and the official RotationZoo's), the hub, the bundled sets, and absorption into weights.

Builds on :mod:`oscar_hf.core`; imports nothing from :mod:`oscar_hf.evaluation` or :mod:`oscar_hf.cli`.
"""
