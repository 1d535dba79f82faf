"""`split_packed`: views of one packed tensor whose gradient comes back as one buffer, uncopied.

`torch.split` / `torch.unbind` backward always builds the packed gradient anew (a cat or stack;
`select` views cost a zero-filled buffer each, a copy into it and a sum). The eager attention
backward writes the gradients of q/k/v views that tile one packed buffer into views of one new
buffer laid out the same way (`fusedlayers.kernels` ops, `_packed.py`); `split_packed`'s backward
sees that its incoming gradients are exactly the matching views of one such buffer and returns
that buffer, viewed with the packed tensor's shape and strides. Anything else (a gradient that
went through a copy, RoPE, a missing one) falls back to cat/stack: always correct, just a copy.

Autograd semantics stay exact: every piece is a real view with its own graph node, so
`torch.autograd.grad(out, [q])` and `q.retain_grad()` see q's gradient as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """A sufficient test that no two elements share memory: with dims sorted by stride, each
    stride steps past everything the smaller dims address."""
    reach = 0  # the largest offset the dims so far address
    for size, stride in sorted((p for p in zip(shape, strides) if p[0] != 1), key=lambda p: p[1]):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _same_strides(t: torch.Tensor, strides: Sequence[int]) -> bool:
    """Strides equal where they address memory (size-1 dims never do)."""
    return all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), strides))


def _piece_strides(strides: tuple[int, ...], dim: int, unbound: bool) -> tuple[int, ...]:
    return strides[:dim] + strides[dim + 1 :] if unbound else strides


def _as_packed(grads, shape, strides, dim: int, starts: Sequence[int], unbound: bool):
    """The packed gradient as a view of the buffer holding `grads`, when each grads[i] is
    exactly piece i of one tensor with the packed shape and strides; else None.

    Host checks only (storage identity, offsets, strides): no device data is read.
    """
    first = grads[0]
    if any(g is None or g.layout != torch.strided or g.dtype != first.dtype for g in grads):
        return None
    storage = first.untyped_storage().data_ptr()
    base = first.storage_offset() - starts[0] * strides[dim]
    piece_strides = _piece_strides(strides, dim, unbound)
    for g, start in zip(grads, starts):
        if (
            g.untyped_storage().data_ptr() != storage
            or g.storage_offset() != base + start * strides[dim]
            or not _same_strides(g, piece_strides)
        ):
            return None
    return first.as_strided(shape, strides, base)


class _SplitPacked(torch.autograd.Function):
    """`packed.split(sizes, dim)` (or `unbind(dim)` when sizes is None) whose backward returns
    the packed gradient without a copy when the pieces' gradients allow it."""

    @staticmethod
    def forward(ctx, packed: torch.Tensor, dim: int, sizes: tuple[int, ...] | None):
        unbound = sizes is None
        counts = (1,) * packed.shape[dim] if unbound else sizes
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
        ctx.dim, ctx.unbound, ctx.starts = dim, unbound, starts
        ctx.shape, ctx.strides = packed.shape, packed.stride()
        ctx.reusable = _non_overlapping(packed.shape, packed.stride())
        return packed.unbind(dim) if unbound else packed.split(list(sizes), dim)

    @staticmethod
    def backward(ctx, *grads):
        packed = None
        if ctx.reusable:
            packed = _as_packed(grads, ctx.shape, ctx.strides, ctx.dim, ctx.starts, ctx.unbound)
        if packed is None:
            # Always correct: autograd materialized missing gradients as zeros.
            join = torch.stack if ctx.unbound else torch.cat
            packed = join(grads, ctx.dim)
        return packed, None, None


def split_packed(
    packed: torch.Tensor, dim: int, sizes: Sequence[int] | None = None
) -> tuple[torch.Tensor, ...]:
    """Split `packed` along `dim` into views, like `packed.split(sizes, dim)`, or
    `packed.unbind(dim)` when `sizes` is None; its gradient comes back without a copy.

    Shapes: `packed [..., n, ...]` (n at `dim`) -> with sizes `[n_0, n_1, ...]` (sum n), pieces
    `[..., n_i, ...]`; without, n pieces `[..., ...]` (dim removed). For example a fused QKV
    projection's `qkv [s, b, 3, h, d]` -> `q, k, v = split_packed(qkv, 2)`, each `[s, b, h, d]`
    (TransformerEngine's `sb3hd`), or `[t, (h + 2g) * d]` viewed as `[t, h + 2g, d]` ->
    `split_packed(x, 1, [h, g, g])`.

    The pieces are views of `packed` with their own autograd nodes, exactly as split/unbind
    give. In the backward, when the pieces' gradients are exactly the matching views of one
    buffer laid out like `packed` -- which the attention kernels' eager backward produces when
    the pieces (as views: transposed, reshaped without a copy) reach it together -- that buffer
    is returned as the packed gradient; otherwise the gradients are concatenated (stacked), as
    torch does. Under torch.compile, or without a gradient to track, this is plain split/unbind.
    """
    dim = dim % packed.dim()
    plain = torch.compiler.is_compiling() or not (torch.is_grad_enabled() and packed.requires_grad)
    if plain:
        return tuple(packed.unbind(dim) if sizes is None else packed.split(list(sizes), dim))
    return _SplitPacked.apply(packed, dim, None if sizes is None else tuple(sizes))


__all__ = ["split_packed"]
