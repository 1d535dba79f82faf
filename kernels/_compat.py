"""What differs between Triton (and torch) releases and run modes, in one place.

Two fast paths lean on Triton internals that change between releases: the direct launcher
(`_launch.py`: the compiled kernel's C launcher, its argument format) and the Hopper kernels
(`_flash_fwd_sm90.py`, `_flash_bwd_sm90.py`: Gluon, an experimental API). They run on the Triton
releases the GPU suite passed on (`TESTED_TRITON`); on any other the launches go through
`kernel[grid]` and the portable kernels take every call, which is correct on every release, and
the `fusedlayers` logger says why once (`FAST_PATHS_OFF`). `FUSEDLAYERS_UNTESTED_TRITON=1` turns
them on outside the window, to test a new release.

The Triton interpreter (`TRITON_INTERPRET=1`) runs the kernels on the CPU. Triton reads the
variable once per kernel, when `@triton.jit` defines it: the kernels of this package are
interpreted or compiled as the variable stood when the package was imported, whatever it says
later. `INTERPRETER` is that import-time state; `interpreter_requested()` is what the variable
says now, so a caller can tell "set too late" from "not set".

The interpreter's `tl.dot` on bf16 operands returns wrong values (Triton issue 11584, seen with
Triton 3.6 to 3.9), so interpreted attention computes bf16 inputs in fp32 (`upcast_bf16`).
"""

from __future__ import annotations

import logging
import os

import torch
import triton

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


# Triton releases (major, minor) on which the GPU suite passed with both fast paths on. 3.9
# (PyPI's newest): the attention kernels' GPU tests (portable and sm_90 forward and backward,
# decode, the kernel entry's), which run both fast paths, with torch 2.11 on an H200.
TESTED_TRITON = ((3, 6), (3, 9))
TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])


def _fast_paths_off() -> str | None:
    """Why the direct launcher and the Hopper kernels are off on this install, or None."""
    if TRITON_VERSION in TESTED_TRITON:
        return None
    if os.environ.get("FUSEDLAYERS_UNTESTED_TRITON", "0") not in ("", "0"):
        return None
    tested = ", ".join(".".join(map(str, v)) for v in TESTED_TRITON)
    return (
        f"Triton {triton.__version__} is outside the releases the GPU suite passed on "
        f"({tested}): the Hopper (sm_90) kernels and the direct launcher are off, every call "
        "takes the portable kernels through kernel[grid]; FUSEDLAYERS_UNTESTED_TRITON=1 turns "
        "them on"
    )


FAST_PATHS_OFF = _fast_paths_off()
# Said where it costs speed: on a machine with a GPU (not on a CPU, not under the interpreter).
if FAST_PATHS_OFF and not INTERPRETER and torch.cuda.is_available():
    logging.getLogger("fusedlayers").warning("fusedlayers: %s", FAST_PATHS_OFF)


__all__ = [
    "FAST_PATHS_OFF", "INTERPRETER", "TESTED_TRITON", "TRITON_VERSION", "interpreter_requested",
    "upcast_bf16",
]  # fmt: skip
