"""The kernel-or-reference choice every entry with a `backend` argument makes the same way.

`backend="auto"` takes the Triton kernel for CUDA tensors it supports, and the PyTorch reference
path otherwise; `"kernel"` insists (an `ArgumentError` naming what the kernel cannot take; CPU
tensors need the Triton interpreter, `TRITON_INTERPRET=1` exported before Python starts);
`"reference"` is the PyTorch path (what `use_reference=True` passes).
"""

from __future__ import annotations

import torch

from .errors import ArgumentError

try:
    from .kernels import _compat
except ImportError as error:  # Triton missing (no Linux wheel) or broken: the reference serves
    _compat, KERNELS_MISSING = None, f"kernels unavailable ({error})"
else:
    KERNELS_MISSING = None

BACKENDS = ("auto", "kernel", "reference")


def check_kernel_device(x: torch.Tensor, name: str) -> None:
    """The kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter; raise
    naming `name`'s device otherwise, and say so when the interpreter was asked for too late."""
    if x.is_cuda or _compat.INTERPRETER:
        return
    if _compat.interpreter_requested():
        raise ArgumentError(
            f"TRITON_INTERPRET=1 was set after fusedlayers was imported, so the kernels were "
            f"defined for a GPU and cannot take {name} on {x.device}: Triton reads the variable "
            "once, when it defines a kernel. Export it before Python starts "
            "(`TRITON_INTERPRET=1 python ...`) or set it before `import fusedlayers`"
        )
    raise ArgumentError(
        f"the Triton kernels need CUDA tensors, got {name} on {x.device}; to run them on the CPU "
        "interpreter (fp16/fp32; bf16 is computed in fp32 there), export TRITON_INTERPRET=1 "
        "before Python starts. The modules take the PyTorch reference path on a CPU by themselves"
    )


def choose_backend(
    backend: str, x: torch.Tensor, name: str, blocker: str = "", not_worth: str = ""
) -> tuple[bool, str]:
    """(run the kernel?, why) for tensor `x` (called `name` in messages).

    `blocker`: why the kernel cannot take this call ("" when it can). `not_worth`: why `auto`
    should not take it although it could (a measured break-even), "" when it should.
    """
    if backend not in BACKENDS:
        raise ArgumentError(f"backend ({backend!r}) must be one of {BACKENDS}")
    if backend == "reference":
        return False, "use_reference=True"
    if KERNELS_MISSING is not None:
        if backend == "kernel":
            raise RuntimeError(f"backend='kernel': the kernels cannot run: {KERNELS_MISSING}")
        return False, f"{KERNELS_MISSING}: reference path"
    if backend == "kernel":
        if blocker:
            raise ArgumentError(f"backend='kernel': {blocker}")
        check_kernel_device(x, name)
        return True, "backend='kernel'"
    if not x.is_cuda:
        return False, f"{name} on {x.device} (no CUDA): reference path"
    if not_worth:
        return False, f"{not_worth}: reference path"
    if blocker:
        return False, f"{blocker}: reference path"
    return True, "CUDA tensors"
