"""The kernel-or-reference choice every entry with a `backend` argument makes the same way.

`backend="auto"` takes the Triton kernel for CUDA tensors it supports, and the PyTorch reference
path otherwise; `"kernel"` insists (a ValueError naming what the kernel cannot take, and CPU
tensors need `TRITON_INTERPRET=1`); `"reference"` is the PyTorch path (what `use_reference=True`
passes).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "kernel", "reference")


def choose_backend(
    backend: str, x: torch.Tensor, name: str, blocker: str, not_worth: str = ""
) -> tuple[bool, str]:
    """(run the kernel?, why) for tensor `x` (called `name` in messages).

    `blocker`: why the kernel cannot take this call ("" when it can). `not_worth`: why `auto`
    should not take it although it could (a measured break-even), "" when it should.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend ({backend!r}) must be one of {BACKENDS}")
    if backend == "reference":
        return False, "use_reference=True"
    if backend == "kernel":
        if blocker:
            raise ValueError(f"backend='kernel': {blocker}")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                f"backend='kernel' needs CUDA tensors, got {name} on {x.device}; set "
                "TRITON_INTERPRET=1 to run the kernel on the CPU interpreter"
            )
        return True, "backend='kernel'"
    if not x.is_cuda:
        return False, f"{name} on {x.device} (no CUDA): reference path"
    if not_worth:
        return False, f"{not_worth}: reference path"
    if blocker:
        return False, f"{blocker}: reference path"
    return True, "CUDA tensors"
