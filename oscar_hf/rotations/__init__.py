"""Rotation sets and where they come from: the :class:`~oscar_hf.rotations.rotation_set.RotationSet`, its
files (our format and the official RotationZoo's), the hub, the bundled sets and resolving a set for a
model. Below the cache (:mod:`oscar_hf.core`), which uses them; fitting rotations is
:mod:`oscar_hf.calibration`.
"""
