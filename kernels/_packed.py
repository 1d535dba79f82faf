"""One gradient buffer for q, k, v that are views of one packed tensor.

When q, k and v (or two of them, or one alone) are views that exactly tile a dense block of one
storage -- `sb3hd`'s `buf[:, :, i]`, `bshd_bs2hd`'s k/v, heads split from one projection output --
the eager backward allocates one flat buffer the size of that block and has the kernels write
dq/dk/dv into `as_strided` views of it with the inputs' own strides and relative offsets. The
gradients then sit in memory exactly as q/k/v do, so whatever split the caller made can return
the packed gradient as one more view instead of concatenating (`fusedlayers.split_packed`).

Exact tiling is required: an element of the block that no view owns would be left unwritten
(garbage in the packed gradient), and two views sharing an element would overwrite each other's
gradient. The proof works from shapes, strides and storage offsets alone (never device data) and
is memoized per geometry, since training repeats the same one every step.

Geometry per view: `(shape, strides, offset)` with the offset relative to the lowest offset of
its group. Tiling means the views' element offsets together are `0 .. numel - 1`, each once,
where `numel` is the sum of the views' element counts.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

# A coverage array larger than this is not built: the plan says "not proven" and the backward
# allocates separate contiguous gradients, as it always did.
MAX_PERIOD = 1 << 20

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, strides, relative offset)


class GradGroup(NamedTuple):
    """Inputs (indices into (q, k, v)) whose gradients share one flat buffer of `numel`."""

    members: tuple[int, ...]
    offsets: tuple[int, ...]  # each member's storage offset in the flat buffer
    numel: int


def _dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """(size, stride) pairs that address memory: size-1 dims never move the pointer."""
    return [(n, s) for n, s in zip(shape, strides) if n != 1]


def _dim_with_stride(views: list, stride: int) -> tuple[int, int] | None:
    """The one (size, stride) dim that every view has with this stride, or None."""
    found = set()
    for dims, _ in views:
        matches = [d for d in dims if d[1] == stride]
        if len(matches) != 1:
            return None
        found.add(matches[0])
    return found.pop() if len(found) == 1 else None


def _strip_inner(views: list, total: int) -> tuple[list, int]:
    """Factor out the innermost dims all views share, while they continue the unit.

    Invariant: what has been stripped enumerates [0, unit) once per remaining element, and every
    remaining stride and offset is a multiple of `unit`. A dim (n, unit) in every view keeps it
    when all other strides, offsets and the total are multiples of n * unit. The views then tile
    [0, total) iff the remaining ones, divided by the unit, tile [0, total / unit). Returns those
    and total / unit.
    """
    unit = 1
    while (dim := _dim_with_stride(views, unit)) is not None:
        step = dim[0] * unit
        rest = [([d for d in dims if d != dim], off) for dims, off in views]
        values = [s for dims, _ in rest for _, s in dims] + [off for _, off in rest] + [total]
        if any(v % step for v in values):
            break
        views, unit = rest, step
    scaled = [([(n, s // unit) for n, s in dims], off // unit) for dims, off in views]
    return scaled, total // unit


def _strip_outer(views: list, period: int) -> tuple[list, int]:
    """Factor out outermost dims every view shares and that span the period (n * stride).

    A dim (n, r) with n * r == period in every view: the views tile [0, period) iff what is left
    of them tiles [0, r). Returns the views and the new period.
    """
    while True:
        shared = [d for d in views[0][0] if all(d in dims for dims, _ in views[1:])]
        outer = [d for d in shared if d[0] * d[1] == period]
        if not outer:
            return views, period
        dim = max(outer, key=lambda d: d[1])
        for dims, _ in views:
            dims.remove(dim)  # one occurrence: a repeated dim stays and fails coverage
        period = dim[1]


def _covers_once(views: list, period: int) -> bool:
    """Whether the views' element offsets are exactly 0 .. period - 1, each once."""
    if period > MAX_PERIOD or sum(_count(dims) for dims, _ in views) != period:
        return False
    seen = torch.zeros(period, dtype=torch.int32)
    for dims, off in views:
        index = torch.full((1,), off, dtype=torch.int64)
        for n, s in dims:
            index = (index[:, None] + torch.arange(n, dtype=torch.int64)[None, :] * s).flatten()
        if index.min() < 0 or index.max() >= period:
            return False
        seen.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    return bool((seen == 1).all())


def _count(dims: list[tuple[int, int]]) -> int:
    count = 1
    for n, _ in dims:
        count *= n
    return count


@functools.lru_cache(maxsize=256)
def tiles_exactly(geometries: tuple[Geometry, ...]) -> bool:
    """Whether views with these geometries cover offsets 0 .. sum(numel) - 1, each exactly once.

    Exact and cheap: shared inner dims scale the problem down, shared outer dims cut it to one
    period, and a boolean array of that period settles the rest. Periods over `MAX_PERIOD`
    elements give False ("not proven"), which only costs the old, always-correct path.
    """
    total = 0
    views = []
    for shape, strides, offset in geometries:
        numel = _count(list(zip(shape, strides)))
        if numel == 0 or offset < 0:
            return False
        total += numel
        views.append((_dims(shape, strides), offset))
    views, period = _strip_inner(views, total)
    views, period = _strip_outer(views, period)
    return _covers_once(views, period)


def plan_packed_grads(*tensors: torch.Tensor) -> tuple[GradGroup, ...]:
    """Groups of `tensors` whose gradients can share one flat buffer (see the module docstring).

    Tensors on one storage with one dtype form a group when together they tile a dense block of
    it. A tensor alone qualifies when it is dense but not contiguous (e.g. an sbhd tensor seen as
    bshd): its gradient then gets its strides and autograd need not copy it into them. Tensors in
    no group get separate contiguous gradients, as before. Host only, a few us per call: the
    work is memoized on the geometry (shapes, strides, relative offsets, which share storage).
    """
    if all(map(_fills_its_storage, tensors)):
        # Separate tensors, each its storage's only contents (the common call): no tensor can
        # tile anything with another, and a contiguous one needs no group of its own.
        return ()
    storages = [(t.untyped_storage().data_ptr(), t.dtype) for t in tensors]
    owner = tuple(storages.index(key) for key in storages)  # first tensor on the same storage
    offsets = [t.storage_offset() for t in tensors]
    relative = tuple(off - offsets[first] for off, first in zip(offsets, owner))
    # torch.Size hashes and compares as the tuple it is.
    shapes = tuple(t.shape for t in tensors)
    return _plan(owner, relative, shapes, tuple(t.stride() for t in tensors))


def _fills_its_storage(t: torch.Tensor) -> bool:
    """t is contiguous and covers its whole storage: any tensor on the same storage overlaps it."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


@functools.lru_cache(maxsize=256)
def _plan(owner, relative, shapes, strides) -> tuple[GradGroup, ...]:
    """plan_packed_grads on the geometry: `owner[i]` is the first tensor sharing i's storage,
    `relative[i]` i's storage offset minus that tensor's."""
    groups = []
    for first in sorted(set(owner)):
        members = tuple(i for i in range(len(owner)) if owner[i] == first)
        if len(members) == 1 and _is_contiguous(shapes[first], strides[first]):
            continue
        low = min(relative[i] for i in members)
        offsets = tuple(relative[i] - low for i in members)
        geometries = tuple((shapes[i], strides[i], off) for i, off in zip(members, offsets))
        if tiles_exactly(geometries):
            numel = sum(_count(list(zip(shapes[i], strides[i]))) for i in members)
            groups.append(GradGroup(members, offsets, numel))
    return tuple(groups)


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in reversed(list(zip(shape, strides))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def packed_grad_buffers(
    plan: tuple[GradGroup, ...], *tensors: torch.Tensor
) -> list[torch.Tensor | None]:
    """Per tensor, its gradient as a view of its group's new flat buffer (None: not planned).

    Each view has the tensor's shape and strides at the tensor's offset within the group, so the
    gradients lie in their buffer as the tensors lie in theirs. The buffers are uninitialized:
    the kernels write every element (and zero the rows no sequence owns).
    """
    grads: list[torch.Tensor | None] = [None] * len(tensors)
    for group in plan:
        like = tensors[group.members[0]]
        flat = torch.empty(group.numel, dtype=like.dtype, device=like.device)
        for i, offset in zip(group.members, group.offsets):
            grads[i] = flat.as_strided(tensors[i].shape, tensors[i].stride(), offset)
    return grads
