"""What the kernel tests share: tolerances against the torch references, and a PTX subset run on the CPU."""

from __future__ import annotations

import torch

TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    # the compiled kernel rounds its softmax weights to fp16 or bf16 for the MMA: 4.9e-3 measured at outputs
    # up to 2.6 in fp16; in bf16 up to 2.1e-2, on an H100 at an output near zero (split partials cancel)
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2.5e-2, rtol=1.6e-2),
}


def run_ptx(ptx: str, registers: dict[str, int]) -> dict[str, int]:
    """Execute the PTX subset of the unpacking asm (mov, prmt, shr, shl, and, lop3 on 32-bit registers)
    from the given input registers; returns every register."""
    registers = dict(registers)
    for statement in filter(None, (line.strip() for line in ptx.strip("{} ").split(";"))):
        op, operands = statement.split(None, 1)
        if op == ".reg":
            continue
        dest, *sources = [x.strip() for x in operands.split(",")]
        values = [registers[x] if x in registers or x.startswith("$") else int(x, 0) for x in sources]
        if op == "prmt.b32":
            pool = values[0].to_bytes(4, "little") + values[1].to_bytes(4, "little")
            result = bytes(pool[(values[2] >> (4 * i)) & 7] for i in range(4))
            registers[dest] = int.from_bytes(result, "little")
        elif op == "shr.b32":
            registers[dest] = values[0] >> values[1]
        elif op == "and.b32":
            registers[dest] = values[0] & values[1]
        elif op == "shl.b32":
            registers[dest] = (values[0] << values[1]) & 0xFFFFFFFF
        elif op == "mov.b32":
            registers[dest] = values[0]
        else:
            assert op == "lop3.b32", statement
            registers[dest] = _lop3(*values)
    return registers


def _lop3(a: int, b: int, c: int, table: int) -> int:
    """``lop3.b32``: bit i of the result is bit ``4 a_i + 2 b_i + c_i`` of ``table`` (a = 0xF0, b = 0xCC, c = 0xAA)."""
    result, ones = 0, 0xFFFFFFFF
    for row in range(8):
        if table >> row & 1:
            result |= (a if row & 4 else ~a) & (b if row & 2 else ~b) & (c if row & 1 else ~c) & ones
    return result
