"""The cache itself: configuration, packed storage, the per-layer state machine, the container, the
``"oscar"`` attention, teacher forcing, frozen (static) decoding and model loading.

Imports nothing from :mod:`oscar_hf.rotations`, :mod:`oscar_hf.evaluation` or :mod:`oscar_hf.cli`.
"""
