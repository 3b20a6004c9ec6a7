"""Development switches of the Gluon history span (:class:`SpanVariant`; the defaults are production)
and the bit widths it reads (:data:`BIT_WIDTHS`).

Kept apart from the kernel so that the decode launcher and the tools can name a variant and route a
shape without importing Gluon, which older Tritons lack.
"""

from __future__ import annotations

import dataclasses

import torch

# (K bits, V bits) the span reads: 3- and 4-bit keys and 1-bit values as the 2-bit words' blocks
# (gluon_span_tiles._key_words, _value_words); only 2/2 is staged (pipeline=True).
BIT_WIDTHS = ((2, 2), (4, 2), (2, 1), (4, 1), (3, 2), (3, 1))

# Registers a thread, capped (``maxnreg``) so that 16 one-warp programs fit an SM; uncapped the span
# takes a little more and fits fewer, and lower caps fit more programs but run slower, because some
# of an SM's 4 schedulers then get a fifth warp that sets the pace (kernels/DESIGN.md).
REGISTERS = 128


def programs_per_sm(registers: int = REGISTERS) -> int:
    """One-warp programs an SM holds at ``registers`` a thread (65536 registers an SM)."""
    return 65536 // (32 * registers)


@dataclasses.dataclass(frozen=True, eq=False)
class SpanVariant:
    """Variants of the span for kernel development (kernels/tools/); the defaults are the production
    kernel. ``two_halves=False`` splits no tile into halves (:func:`.gluon_span_layouts.halves`);
    ``registers`` caps the registers a thread (``maxnreg``), and the decode call sizes its splits by the
    programs an SM that cap fits; ``timeline``, a zeroed int64 buffer of at least ``batch * kv heads *
    splits * TIMELINE_FIELDS``, receives each program's timeline (see
    :data:`.gluon_span_kernel.TIMELINE_FIELDS`)."""

    two_halves: bool = True
    registers: int = REGISTERS
    timeline: torch.Tensor | None = None

    def programs_per_sm(self) -> int:
        return programs_per_sm(self.registers)


PRODUCTION = SpanVariant()
