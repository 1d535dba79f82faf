"""Repeat one call at one signature, in every order that a cache keyed by the signature could
get wrong, and check every result.

Everything the front end, the launchers, the KV-cache checks and the context-parallel ring
compute once per call signature is kept between calls. A bug in such a cache shows only on a
later call: reused input tensors (a training loop's, a benchmark's), a call with grad after one
without, another signature in between. Each sequence below repeats a signature at least three
times, with and without grad in both orders, and interleaved with a second signature. The same
leaf tensors serve every call of a signature; gradients reach them both through
`torch.autograd.grad` and through `.backward()` into `.grad` (zeroed in place first, as
`optimizer.zero_grad(set_to_none=False)` does, so every call's gradient is checked alone).

A call is `run(signature, mode) -> (out, grads or None)`, mode one of:
    "nograd"    under torch.no_grad()
    "grad"      forward with grad, gradients by torch.autograd.grad
    "backward"  forward with grad, out.backward(dout), gradients read off .grad
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MODES = ("nograd", "grad", "backward")

SEQUENCES = {
    "grad then nograd": [("A", "grad"), ("A", "backward"), ("A", "backward")]
    + [("A", "nograd")] * 3,
    "nograd then grad": [("A", "nograd")] * 3 + [("A", "backward"), ("A", "grad")] * 2,
    "interleaved": [
        ("A", "backward"), ("B", "backward"), ("A", "nograd"), ("B", "grad"),
        ("A", "backward"), ("B", "nograd"), ("A", "grad"), ("A", "backward"),
    ],
}  # fmt: skip


def grads_of(out: torch.Tensor, leaves: tuple[torch.Tensor, ...], dout, mode: str):
    """The gradients of `out` for `leaves` by `mode` (None for "nograd")."""
    if mode == "nograd":
        return None
    if mode == "grad":
        return torch.autograd.grad(out, leaves, dout)
    for t in leaves:
        if t.grad is not None:
            t.grad.zero_()  # kept, as an optimizer keeps it: AccumulateGrad adds in place
    out.backward(dout)
    return tuple(t.grad.clone() for t in leaves)


def run_sequence(
    run: Callable[[str, str], tuple], check: Callable[[str, str, int, tuple], None], order: str
) -> int:
    """Call `run(signature, mode)` along `SEQUENCES[order]` and `check(signature, mode, i,
    result)` after each call; returns the number of calls."""
    for i, (signature, mode) in enumerate(SEQUENCES[order]):
        with torch.set_grad_enabled(mode != "nograd"):
            result = run(signature, mode)
        check(signature, mode, i, result)
    return len(SEQUENCES[order])
