"""Instructions per history tile of the decode kernels, compiled for an H100/H200 (sm_90) on any machine.

    python kernels/tools/sass_count.py [--warps 1] [--block-n 64] [--ring] [--bits 2/2 3/2 2/1] [--head-dim 64] [--sass out.sass]
    python kernels/tools/sass_count.py --span [--registers 128] [--bits 2/2 4/2 2/1 4/1 3/2 3/1]

No GPU is needed: Triton compiles the stage-1 kernel (or, ``--span``, the Gluon history span of
``kernels/gluon_span_kernel.py``) for ``GPUTarget("cuda", 90, 32)`` with the argument types and
specialisations of a Qwen3-8B launch (32 query heads, 8 KV heads, head_dim 128 or ``--head-dim``,
INT2 K and V or the other ``--bits``, 100K history), and Triton's bundled ``cuobjdump`` prints the SASS. The tile's instructions, mostly integer
unpacking, are one of the history loop's bounds (``kernels/DESIGN.md``); this counts them without
device time. ``--span`` prints the registers, the loop's instructions and those before it for each
variant: the history length as an argument or read on the device (``ring``), tiles staged or not
(staged for 2-bit K and V only), for each ``--bits`` K/V width (default 2/2).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch


class _Sm90Driver:
    """Just enough of a Triton driver to compile (never launch) for sm_90 without a GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def compile_stage1(
    num_warps: int, block_n: int, ring: bool, history: int = 100_000, dims: int = 128, k_bits: int = 2, v_bits: int = 2
):
    """The compiled stage-1 kernel for a Qwen3-8B-shaped batch-1 launch (types and alignments only), at
    ``dims`` a head and ``k_bits``/``v_bits`` a code."""
    from triton.runtime import driver

    driver.set_active(_Sm90Driver())
    from oscar_hf.kernels import decode_launch, decode_stages
    from oscar_hf.kernels.decode_unpack import CODE_MAGIC, shift_free_blocks, unpack_asm

    bf16, u8, f32 = torch.bfloat16, torch.uint8, torch.float32
    kv_heads = 8
    dense = (kv_heads * 512 * dims, 512 * dims, dims)
    k_row, v_row = k_bits * dims // 8, v_bits * dims // 8  # bytes a packed row
    k_codes, v_codes = (
        (kv_heads * history * k_row, history * k_row, k_row),
        (kv_heads * history * v_row, history * v_row, v_row),
    )
    meta = (kv_heads * history, history, 1)
    magic, offset = CODE_MAGIC[bf16][:2]
    block_h, head_blocks, _ = decode_launch._block_sizes(4, dims, block_n)
    args = (
        bf16,
        (32 * dims, dims),
        bf16,
        dense,
        bf16,
        dense,
        64,
        64,
        bf16,
        dense,
        bf16,
        dense,
        264,
        256,
        bf16,
        dense,
        bf16,
        dense,
        1,
        16,
        u8,
        k_codes,
        bf16,
        meta,
        bf16,
        meta,
        u8,
        v_codes,
        bf16,
        meta,
        bf16,
        meta,
        history,
        1536,
        bf16,
        128,
        f32,
        f32,
        f32,
        0.088,
        66,
        2,
        72,
        0,
        torch.int64 if ring else bf16,
    )  # the launcher's argument order
    return decode_stages._decode_stage1_kernel.warmup(
        *args,
        grid=(1,),
        GROUP=4,
        HEAD_BLOCKS=head_blocks,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DENSE_BLOCK_N=16,
        D=dims,
        K_BITS=k_bits,
        K_GROUPS=1,
        V_BITS=v_bits,
        V_GROUPS=1,
        MAGIC=magic,
        OFFSET=offset,
        K_FREE=shift_free_blocks(k_bits, bf16),
        V_FREE=shift_free_blocks(v_bits, bf16),
        K_UNPACK=unpack_asm(k_bits, bf16),
        V_UNPACK=unpack_asm(v_bits, bf16),
        HAS_MASK=False,
        RING=ring,
        INTERPRETED=False,
        AFTER_SPAN=False,
        num_warps=num_warps,
        num_stages=decode_launch._STAGES,
    )


def compile_span(ring: bool, pipeline: bool, registers: int, k_bits: int = 2, v_bits: int = 2, history: int = 100_000):
    """The compiled Gluon history span for a Qwen3-8B-shaped batch-1 launch (types and alignments only)."""
    from triton.runtime import driver

    driver.set_active(_Sm90Driver())
    from oscar_hf.kernels.gluon_span_kernel import history_kernel
    from oscar_hf.kernels.gluon_span_layouts import halves
    from oscar_hf.kernels.gluon_span_operands import value_unpack_asm

    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    k_words, v_words = 4 * k_bits, 4 * v_bits  # a row's
    meta = (8 * history, history)
    return history_kernel.warmup(
        bf16,
        32 * 128,
        i32,
        8 * history * k_words,
        history * k_words,
        i32,
        8 * history * v_words,
        history * v_words,
        bf16,
        bf16,
        bf16,
        bf16,
        *meta,
        history,
        768,
        f32,
        f32,
        f32,
        137,
        0.1275,
        torch.int64 if ring else bf16,
        bf16,
        GROUP=4,
        V_UNPACK=value_unpack_asm(v_bits),
        RING=ring,
        PIPELINE=pipeline,
        LAUNCH_DEPENDENTS=True,
        EARLY=pipeline,
        PACK=halves(4),
        TIMED=False,
        K_BITS=k_bits,
        V_BITS=v_bits,
        K_ROW=k_words,
        V_ROW=v_words,
        grid=(1,),
        num_warps=1,
        maxnreg=registers,
    )  # history_into's argument order


def print_span(registers: int, widths: list[tuple[int, int]]) -> None:
    """Registers, shared memory and loop instructions of each variant of the span, by K/V bit width."""
    for k_bits, v_bits in widths:
        print(f"K{k_bits} V{v_bits}")
        staged = (False, True) if (k_bits, v_bits) == (2, 2) else (False,)
        for pipeline in staged:
            for ring in (False, True):
                _print_variant(compile_span(ring, pipeline, registers, k_bits, v_bits), ring, pipeline)


def _print_variant(compiled, ring: bool, pipeline: bool) -> None:
    sass = sass_of(compiled)
    ops = history_loop(sass)
    print(
        f"ring={ring} pipeline={pipeline}: {resource_usage(compiled)}; "
        f"shared {compiled.metadata.shared} B; {sum(ops.values())} instructions per 64-key tile, "
        f"{before_loop(sass)} before the loop"
    )
    print("  " + ", ".join(f"{op} {count}" for op, count in ops.most_common()))


def resource_usage(compiled) -> str:
    """Registers, stack and local memory a thread of ``compiled`` takes (from ``cuobjdump``)."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(_cuobjdump()), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
        ).stdout
    return " ".join(re.findall(r"REG:\d+|STACK:\d+|LOCAL:\d+", usage))


def _cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def sass_of(compiled) -> str:
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        done = subprocess.run(
            [str(_cuobjdump()), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True
        )
        return done.stdout


def _instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, text)`` of each SASS instruction."""
    return [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+(.*?)\s*;", sass)]


def _backward_branches(instructions: list[tuple[int, str]]):
    """``(index, target address)`` of each branch back to an earlier instruction (a loop's end)."""
    for i, (address, text) in enumerate(instructions):
        branch = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            yield i, int(branch.group(1), 16)


def history_loop(sass: str) -> collections.Counter:
    """Opcode counts of the largest loop with tensor-core instructions (the packed-history loop)."""
    instructions = _instructions(sass)
    position = {address: i for i, (address, _) in enumerate(instructions)}
    best: list[str] = []
    for i, target in _backward_branches(instructions):
        body = [t for _, t in instructions[position[target] : i + 1]]
        if any("HMMA" in t for t in body) and len(body) > len(best):
            best = body
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best)


def before_loop(sass: str) -> int:
    """Instructions ahead of the first loop's start (its prologue)."""
    instructions = _instructions(sass)
    for _, target in _backward_branches(instructions):
        return sum(1 for address, _ in instructions if address < target)
    return len(instructions)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warps", type=int, default=0, help="default: the launcher's")
    parser.add_argument("--block-n", type=int, default=0, help="default: the launcher's (at head_dim 128)")
    parser.add_argument("--ring", action="store_true", help="the static-decoding (device lengths) variant")
    parser.add_argument("--sass", type=Path, help="also write the whole SASS here")
    parser.add_argument("--span", action="store_true", help="the Gluon history span instead of the stage-1 kernel")
    parser.add_argument("--registers", type=int, default=0, help="the span's register cap (default: the kernel's)")
    parser.add_argument(
        "--bits",
        nargs="+",
        default=["2/2"],
        help="K/V bit widths (the span's: 2/2, 4/2, 2/1, 4/1, 3/2, 3/1; default 2/2)",
    )
    parser.add_argument("--head-dim", type=int, default=128, help="the stage-1 kernel's head_dim (default 128)")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    if args.span:
        from oscar_hf.kernels.gluon_span_variant import REGISTERS

        widths = [tuple(int(b) for b in width.split("/")) for width in args.bits]
        print_span(args.registers or REGISTERS, widths)
        return
    from oscar_hf.kernels import decode_launch

    args.warps = args.warps or decode_launch._WARPS
    args.block_n = decode_launch._block_sizes(4, args.head_dim, args.block_n)[2]
    for width in args.bits:
        k_bits, v_bits = (int(b) for b in width.split("/"))
        compiled = compile_stage1(args.warps, args.block_n, args.ring, dims=args.head_dim, k_bits=k_bits, v_bits=v_bits)
        sass = sass_of(compiled)
        print(
            f"stage 1, K{k_bits} V{v_bits}, head_dim {args.head_dim}: {resource_usage(compiled)}; shared {compiled.metadata.shared} B"
        )
        if args.sass:
            args.sass.write_text(sass)
        ops = history_loop(sass)
        total = sum(ops.values())
        per_key = total * args.warps / args.block_n
        print(
            f"history loop: {total} instructions per thread per {args.block_n}-key tile at {args.warps} warps "
            f"= {per_key:.1f} warp-instructions per key"
        )
        print("  " + ", ".join(f"{op} {count}" for op, count in ops.most_common(16)))


if __name__ == "__main__":
    main()
