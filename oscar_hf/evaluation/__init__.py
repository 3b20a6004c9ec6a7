"""Evaluation: held-out KL and perplexity, KL over context, needles (generated and teacher-forced),
the demo, task evaluation and the lm-eval model, and the report files they write.

Builds on :mod:`oscar_hf.core` and :mod:`oscar_hf.rotations`; imports nothing from :mod:`oscar_hf.cli`.
"""
