"""What differs between Triton (and torch) releases and run modes, in one place.

The Triton interpreter (`TRITON_INTERPRET=1`) runs the kernels on the CPU. Triton reads the
variable once per kernel, when `@triton.jit` defines it: the kernels of this package are
interpreted or compiled as the variable stood when the package was imported, whatever it says
later. `INTERPRETER` is that import-time state; `interpreter_requested()` is what the variable
says now, so a caller can tell "set too late" from "not set".

The interpreter's `tl.dot` on bf16 operands returns wrong values (Triton issue 11584, seen with
Triton 3.6 to 3.9), so interpreted attention computes bf16 inputs in fp32 (`upcast_bf16`).
"""

from __future__ import annotations

import os

import torch

try:
    from triton import knobs
except ImportError:  # Triton < 3.4: the variable is read directly
    knobs = None


def interpreter_requested() -> bool:
    """Whether `TRITON_INTERPRET` asks for the interpreter now, parsed as Triton parses it."""
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Fixed at import, like the kernels themselves (module docstring).
INTERPRETER = interpreter_requested()


def upcast_bf16(dtype: torch.dtype) -> bool:
    """Whether attention on inputs of `dtype` runs in fp32 (the interpreter's bf16 `tl.dot`)."""
    return INTERPRETER and dtype == torch.bfloat16


__all__ = ["INTERPRETER", "interpreter_requested", "upcast_bf16"]
