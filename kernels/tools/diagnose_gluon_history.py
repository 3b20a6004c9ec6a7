"""Where the Gluon history span goes wrong, if it does: its per-split partials against torch's.

    python kernels/tools/diagnose_gluon_history.py [--out DIR]      # on a GPU
    python kernels/tools/diagnose_gluon_history.py --reference-only # anywhere: checks the torch side

Qwen3-8B's group shape (4 query heads on a KV head, head_dim 128, INT2 K and V) over 300 history
rows in 3 splits, the last ending in a partial tile. The span's ``(m, l, acc)`` of every split is
compared with a float32 torch computation of the same split (base-2 scores, as the kernels keep
them). How to read it:

* ``m`` and ``l`` depend on the scores only: wrong there points at the K path (the K relabelling,
  the q gather, K's unpacking, the key metadata);
* ``acc`` wrong with ``m`` and ``l`` right points at the value path (``movmatrix``, the V
  relabelling, V's unpacking);
* ``acc``'s error by column block j (dims 32j..32j+31) and by byte within a block (dim mod 32) says
  which relabelling: a block's codes come from one bit pair of every byte.

Writes ``gluon_history_diagnosis.json`` (with ``--out``) and prints the same.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from oscar_hf.kernels.decode_attention import DecodeTiers, decode_attention_reference
from oscar_hf.kernels.decode_history_gluon import merge_partials
from oscar_hf.kernels.testing import decode_inputs, reference_partials

SM_SCALE = 0.088


def differences(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> dict:
    """Largest differences of m, l (relative) and acc / l, the last also by column block and byte."""
    (m, l, acc), (m_ref, l_ref, acc_ref) = [[t.float().cpu() for t in side] for side in (got, want)]
    # each side relative to its own max: rescale the span's partials to the reference's max
    rescale = torch.exp2(m - m_ref)
    acc_error = ((acc * rescale[..., None] - acc_ref) / l_ref[..., None]).abs()  # [B, Hq, S, D]
    per_dim = acc_error.amax(dim=(0, 1, 2))
    return {
        "m_max_abs": (m - m_ref).abs().max().item(),
        "l_max_rel": ((l * rescale - l_ref).abs() / l_ref).max().item(),
        "acc_max_abs_over_l": acc_error.max().item(),
        "acc_by_column_block": per_dim.view(4, 32).amax(1).tolist(),
        "acc_by_byte_in_block": per_dim.view(4, 32).amax(0).tolist(),
        "acc_by_head": acc_error.amax(dim=(0, 2, 3)).tolist(),
        "acc_by_split": acc_error.amax(dim=(0, 1, 3)).tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reference-only", action="store_true", help="check the torch partials (no GPU)")
    options = parser.parse_args()
    device = "cpu" if options.reference_only else "cuda"
    q, tiers = decode_inputs(1, 4, 1, 128, 0, 300, 0, 0, torch.bfloat16, 2, 2, seed=3, device=device)
    packed = list(tiers.flat()[2:8])
    want = reference_partials(q, packed, splits=3, sm_scale=SM_SCALE)
    merged = merge_partials(*want)
    exact = [t.float() if t.is_floating_point() else t for t in tiers.flat()]
    full = decode_attention_reference(q.float(), DecodeTiers.from_flat(exact, 2, 2), sm_scale=SM_SCALE)
    report = {"reference_vs_whole_softmax_max_abs": (merged - full).abs().max().item()}
    if not options.reference_only:
        from oscar_hf.kernels.decode_history_gluon import history_partials

        report.update(differences(history_partials(q, *packed, sm_scale=SM_SCALE, splits=3), want))
    print(json.dumps(report, indent=1))
    if options.out:
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "gluon_history_diagnosis.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
