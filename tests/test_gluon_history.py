"""The explicit-layout (Gluon) prototype of the history span against the torch reference: GPU only.

Gluon has no interpreter mode, so these tests skip without CUDA; CI keeps testing the Triton kernel.
"""

import pytest
import torch

from oscar_hf.kernels.decode_attention import decode_attention_reference

from tests.test_kernels import TOLERANCE, _decode_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels need a CUDA GPU")


@pytest.mark.parametrize("prefetch", [False, True], ids=["load-in-loop", "prefetch"])
@pytest.mark.parametrize("batch, q_heads, kv_heads, history, splits", [
    (1, 32, 8, 4133, 16),  # Qwen3-8B attention shape, a partial last tile in the last split
    (2, 8, 2, 1000, 3),  # GQA 4, several splits
    (1, 8, 1, 64, 1),  # exactly one tile
    (2, 16, 2, 300, 4),  # GQA 8: every row of the 8-column value MMA is a head
])  # fmt: skip
def test_history_span_matches_the_reference(prefetch, batch, q_heads, kv_heads, history, splits):
    from oscar_hf.kernels.decode_history_gluon import history_partials, merge_partials

    args, options = _decode_inputs(batch, q_heads, kv_heads, 128, 0, history, 0, 0, torch.bfloat16, 2, 2, seed=3)
    args = [a.cuda() for a in args]
    want = decode_attention_reference(*args, sm_scale=0.088, **options)
    q, _, _, *packed, _, _, _, _ = args
    got = merge_partials(*history_partials(q, *packed, sm_scale=0.088, splits=splits, prefetch=prefetch))
    torch.testing.assert_close(got, want.float(), **TOLERANCE[torch.bfloat16])


def test_history_span_refuses_what_it_does_not_cover():
    from oscar_hf.kernels.decode_history_gluon import history_partials

    args, _ = _decode_inputs(1, 4, 1, 128, 0, 64, 0, 0, torch.bfloat16, 4, 2, seed=3)
    q, _, _, *packed, _, _, _, _ = [a.cuda() for a in args]
    with pytest.raises(ValueError, match="INT2"):
        history_partials(q, *packed, sm_scale=0.088, splits=1)
