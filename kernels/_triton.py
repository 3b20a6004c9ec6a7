"""Shared pieces of the OSCAR Triton kernels, installed as ``oscar_hf.kernels``, each beside its torch reference.

* ``oscar_hf.kernels.quantize.quantize_pack``: the fused write path (clip, quantize, pack), a drop-in
  for :func:`oscar_hf.quant.quantize` with bit-identical codes and metadata; ``quantize_pack_into``
  does many such jobs (every layer's demoted K and V) in one launch, writing into given views.
* ``oscar_hf.kernels.decode_attention.decode_attention``: split-K decode attention over
  ``[sink | packed history | recent | new]``.

Each public function runs its Triton kernel for CUDA tensors (and for CPU tensors when the kernels
were imported with ``TRITON_INTERPRET=1``) and its torch reference otherwise: without Triton, with
``OSCAR_KERNELS=torch``, or for shapes the kernels do not cover (non-power-of-two head dims). The
kernels are also the torch custom ops ``torch.ops.oscar.quantize_pack`` and
``torch.ops.oscar.decode_attention``, with fake implementations, so ``torch.compile`` traces them
(``quantize_pack_into`` writes in place and serves the eager cache only).

The folder has no ``__init__.py`` on purpose: with the repository root on the import path (``python -m
pytest``, ``python -m eval...``), a regular package named ``kernels`` there would shadow Hugging Face's
``kernels`` package, which transformers imports when it finds it; a namespace folder is ignored.

Triton is optional: without it these modules still import (``@triton.jit`` functions become inert
stubs) and everything falls back to the torch references. ``TRITON_INTERPRET=1`` is read by Triton
when a kernel is *decorated*, i.e. when these modules are imported, so it is captured once here as
:data:`INTERPRET`; setting it later has no effect on kernels already defined.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# A cache's history buffers hold whole multiples of this many rows (oscar_hf.core.storage): each head's
# metadata then start 16-byte aligned, as the Gluon span's staged copies need.
ROW_ALIGNMENT = 16
LOG2E = 1.4426950408889634  # scores go to the decode kernels in base-2 units (see decode_tiles._online_softmax)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the library works without Triton, through the torch references
    HAS_TRITON = False

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    class _Constexpr:
        """Holds a module-level constant as ``tl.constexpr(value)`` does (no kernel runs without Triton)."""

        def __init__(self, value=None):
            self.value = value

    triton = SimpleNamespace(jit=_jit)
    tl = SimpleNamespace(constexpr=_Constexpr)


def _patch_interpreter_scalar_index() -> None:
    """Let the Triton 3.6 interpreter use runtime scalars as ``range`` bounds under NumPy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with ``int(array)``, which
    NumPy 2.4 turned into a TypeError, so every loop with a runtime bound fails. This applies the
    upstream fix (triton-lang/triton#9172, squeeze before ``int``) and only in interpreter mode.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_oscar_scalar_index", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._oscar_scalar_index = True
    interpreter._patch_lang_tensor = patched


if HAS_TRITON and INTERPRET:
    _patch_interpreter_scalar_index()


# OSCAR_KERNELS=torch forces the torch references (read once, like TRITON_INTERPRET, so that the
# dispatch below is plain attribute checks that torch.compile traces without graph breaks).
ENABLED = HAS_TRITON and os.environ.get("OSCAR_KERNELS", "auto").lower() != "torch"


def runs_triton(tensor: torch.Tensor) -> bool:
    """Pick Triton for CUDA tensors, or for CPU tensors when the kernels were built for the interpreter."""
    if not ENABLED:
        return False
    # The interpreter copies CUDA arguments to the host and back, so it also serves CUDA tensors (slowly).
    return tensor.is_cuda or (INTERPRET and tensor.device.type == "cpu")


@functools.cache
def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` may launch before the one before them ends (Hopper and later,
    compiled, with a Triton that has grid dependency control)."""
    if INTERPRET or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    from triton.language.extra import cuda

    return hasattr(cuda, "gdc_wait")


def define_op(qualname: str, implementation, fake, mutates: tuple[str, ...] = ()) -> None:
    """Register ``implementation`` as the custom op ``qualname`` (schema from its type hints), once;
    ``mutates`` names the arguments it may write in place.

    Ops are global to the process, so a re-imported kernel module must not define them again; the
    implementations look their launcher up at call time instead (see ``quantize._quantize_pack_op``).
    """
    namespace, name = qualname.split("::")
    if hasattr(getattr(torch.ops, namespace), name):
        return
    op = torch.library.custom_op(qualname, mutates_args=mutates)(implementation)
    op.register_fake(fake)


def op_or_launcher(op, launcher):
    """The custom op while ``torch.compile`` traces (it needs the op), else the launcher itself.

    An eager call through a custom op's Python dispatch costs tens of microseconds, as much as a
    whole decode-attention kernel; the launcher computes the same thing without it.
    """
    return op if torch.compiler.is_compiling() else launcher


# kernel -> {(device, argument traits, keyword arguments): (compiled kernel, trailing arguments)}
_COMPILED: dict = {}


def launch_kernel(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, reusing the compiled binary of an earlier identical launch.

    Triton's dispatch (binding, specialisation, cache key, checks of the kernel's globals, launch
    metadata) took ~130 us of host time per launch on the H200's host under cProfile, three launches
    a layer: more than the kernels themselves at batch 1 (``kernels/measurements/profile_decode.json``). Here
    the binary is keyed by what Triton specialises on, kept at least as fine: each tensor's dtype and
    16-byte alignment, each integer's divisibility by 16, equality to 1 and width, other arguments
    (floats, flags, stride tuples) by value, and the keyword arguments (constexprs and launch options)
    as given. A miss launches through Triton, which compiles or finds the binary. Interpreted
    kernels, and launches that a hook observes (profilers), always go through Triton.
    """
    hooks = triton.knobs.runtime
    if INTERPRET or _observed(hooks.launch_enter_hook) or _observed(hooks.launch_exit_hook):
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    key = (device, _argument_traits(args), tuple(kwargs.items()))
    binaries = _COMPILED.setdefault(kernel, {})
    try:
        cached = binaries.get(key)
    except TypeError:  # an unhashable argument: not keyable
        cached = None
    if cached is None:
        compiled = kernel[grid](*args, **kwargs)
        if not _keyable(args):
            return
        if len(binaries) >= _MAX_BINARIES_PER_KERNEL:
            binaries.clear()
        # the binary takes every parameter in order, constexprs included; launch options are not parameters
        defaults = {param.name: param.default for param in kernel.params}
        trailing = tuple(kwargs.get(name, defaults[name]) for name in kernel.arg_names[len(args) :])
        binaries[key] = (compiled, trailing)
        return
    compiled, trailing = cached
    grid = (*grid, 1, 1)
    stream = triton.runtime.driver.active.get_current_stream(device)
    # no launch metadata and no hooks: none is observed (checked above)
    compiled.run(
        grid[0],
        grid[1],
        grid[2],
        stream,
        compiled.function,
        compiled.packed_metadata,
        None,
        None,
        None,
        *args,
        *trailing,
    )


def _observed(hook) -> bool:
    """Whether a Triton launch hook is set (a function, or since Triton 3.6 a chain with members)."""
    return bool(getattr(hook, "calls", hook))


_I32 = range(-(2**31), 2**31)
_MAX_BINARIES_PER_KERNEL = 4096  # scalars and tuples are keyed by value: a bound against keys that never repeat
_Tensor = torch.Tensor


def _argument_traits(args: tuple) -> tuple:
    """What Triton's specialisation can see of each positional argument, or finer.

    Tensors: dtype and 16-byte alignment; ints: divisibility by 16, equality to 1, width. Everything
    else (floats, flags, stride tuples) is keyed by its value, finer than Triton and cheaper on the
    host (a layer's strides change only when its buffers grow); :func:`_keyable` decides at a miss
    whether such a key may be kept. One expression: this runs for every launch of a decode step.
    """
    return tuple(
        [
            (arg.dtype, arg.data_ptr() % 16 == 0)
            if type(arg) is _Tensor
            else (arg % 16 == 0, arg == 1, arg in _I32, arg >= 2**63)
            if type(arg) is int
            else arg
            for arg in args
        ]
    )


def _keyable(args: tuple) -> bool:
    """Whether every argument keyed by value is a float, flag, None or tuple of ints (strides)."""
    return all(
        type(arg) in (_Tensor, int, float, bool, type(None))
        or (type(arg) is tuple and all(type(value) is int for value in arg))
        for arg in args
    )


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of ints on the host (``triton.cdiv`` is a JIT-wrapped function: ~5 µs a call)."""
    return -(-numerator // denominator)


def split_rows(length: int, splits: int, block_n: int) -> tuple[int, int]:
    """``(splits, chunk)``: ``length`` rows cut into at most ``splits`` chunks of whole ``block_n``-row
    tiles (the last chunk may end in a partial tile; fewer splits where the rounding leaves some empty)."""
    chunk = cdiv(cdiv(length, max(1, splits)), block_n) * block_n
    return cdiv(length, chunk), chunk


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


@triton.jit
def dot(a, b, INTERPRETED: tl.constexpr):
    """``tl.dot`` with float32 accumulation, exact in the interpreter too.

    Triton 3.6's interpreter multiplies bfloat16 bit patterns as integers; upcasting there is exact
    (products of bf16 values fit float32). Compiled float32 dots use IEEE, not TF32, precision.
    """
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x.to(DTYPE)`` for float32 ``x``, rounding to nearest-even also in the interpreter.

    Triton 3.6's interpreter truncates float32 -> bfloat16 conversions (compiled kernels and torch
    round to nearest-even), so there the rounding is done on the bit pattern first, after which the
    truncating conversion is exact. Compiled kernels (``INTERPRETED`` false) use the plain conversion.
    """
    if INTERPRETED:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
