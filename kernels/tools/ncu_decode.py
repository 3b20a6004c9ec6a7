"""Launch the decode-attention kernel a few times for Nsight Compute: where its history kernel stalls.

    ncu --kernel-name regex:history_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \\
        --print-details all python kernels/tools/ncu_decode.py --batch 1 [--splits S --block-n N --warps W --stages T]
        [--staged]

The kernel benchmark's inputs (``eval/configs/bench_kernel.json``: Qwen3-8B attention, INT2 K and V)
at ``--context`` rows, three launches with the given tuning knobs (0: the launcher's defaults). At the
defaults on a GPU the history is the Gluon span's (``history_kernel``); ``--splits``, ``--block-n`` or ``--warps``, or
``OSCAR_DECODE_HISTORY=triton``, gives the Triton stage 1 (``regex:_decode_stage1``); ``--staged``
launches the span alone with its next tile staged in shared memory (``pipeline=True``). No
timing here: timings come from ``kernels/tools/tune_decode.py`` and ``eval/bench_gpu.py``; Nsight Compute
locks the clocks to base and reports cycles, occupancy and stall reasons
(``kernels/measurements/ncu_decode_*.txt``).
"""

from __future__ import annotations

import argparse

import torch
import tune_decode as tune  # a sibling tool: the kernel benchmark's shape and inputs

import oscar_hf.kernels.decode_attention as kernels
from oscar_hf.kernels.testing import TIER_NAMES

CONFIG = tune.CONFIG


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=100_000)
    for knob in ("splits", "block-n", "warps", "stages"):
        parser.add_argument(f"--{knob}", type=int, default=0)
    parser.add_argument("--staged", action="store_true", help="the span alone, next tile staged (pipeline=True)")
    options = parser.parse_args()
    inputs = tune.inputs(options.context, options.batch)
    args = [inputs["q"], *(inputs[name] for name in TIER_NAMES)]
    scale = CONFIG["shape"]["head_dim"] ** -0.5
    knobs = (options.splits, options.block_n, options.warps, options.stages)
    for _ in range(3):
        if options.staged:
            from oscar_hf.kernels.decode_history_gluon import history_partials
            from oscar_hf.kernels.gluon_span_variant import programs_per_sm

            packed = [inputs[name] for name in TIER_NAMES[2:8]]
            splits = tune.splits_for(programs_per_sm(), options.batch)
            history_partials(inputs["q"], *packed, scale, splits, pipeline=True)
        else:
            kernels.decode_attention_triton(*args, None, 2, 2, scale, *knobs)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
