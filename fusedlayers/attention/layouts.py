"""Memory layouts of query/key/value in TransformerEngine's vocabulary, read from strides.

Shapes per `qkv_format` (h = query heads, hg = KV heads, tokens t = sum of sequence lengths):
    sbhd: q [s_q, b, h, d_qk], k [s_kv, b, hg, d_qk], v [s_kv, b, hg, d_v]
    bshd: q [b, s_q, h, d_qk], k [b, s_kv, hg, d_qk], v [b, s_kv, hg, d_v]
    thd:  q [t_q, h, d_qk],    k [t_kv, hg, d_qk],    v [t_kv, hg, d_v]

A layout name is a claim about every stride and storage offset of q, k and v, never about shapes
alone. Per format `f` with token dims `x` (`sb`, `bs` or `t`) there are five (`LAYOUT_DESCRIPTIONS`
says how to build each):
    x3hd       q, k, v = buf[..., i, :, :] of one buffer [x, 3, h, d]
    xh3d       q, k, v = buf[..., i, :]    of one buffer [x, h, 3, d]
    f_x2hd     q dense in f; k, v = kv[..., i, :, :] of one buffer [x, 2, hg, d]
    f_xh2d     q dense in f; k, v = kv[..., i, :]    of one buffer [x, hg, 2, d]
    f_f_f      q, k and v each dense in f (separate allocations, or one after another)
A buffer may start anywhere in its storage: offsets are checked relative to the buffer's start
(the offset of q, or of k for the KV buffer), so a packed buffer carved out of a larger pool keeps
its name.

Anything else is `strided_<q>_<k>_<v>`, where each part is `f` when that tensor alone is dense in
`f` and `view` otherwise. The case this exists for (TransformerEngine issue 1195): q, k, v split
along the head dim of one `[s, b, h + 2*hg, d]` projection output are views whose token strides
span all `h + 2*hg` heads; calling them `sbhd_sbhd_sbhd` made a kernel rebuild dense strides and
read the wrong memory. Here they come out as `strided_view_view_view`.

Strides of size-1 dims never address memory, so a layout also matches when only those differ
(a `[1, s, h, d]` tensor transposed to sbhd is dense); exact strides are tried first, so where
size-1 dims make two names describe the same memory (MQA's `sbhd_sb2hd` and `sbhd_sbh2d`) the
name reflects how the views were built.
"""

from __future__ import annotations

import torch

from ..errors import ArgumentError, ArgumentTypeError
from .validation import QKV_FORMATS

STRIDED = "strided"

# Token dims of each format: what precedes `hd` in the layout names.
_TOKENS = {"sbhd": "sb", "bshd": "bs", "thd": "t"}


def _names(f: str) -> tuple[str, ...]:
    x = _TOKENS[f]
    return (f"{x}3hd", f"{x}h3d", f"{f}_{x}2hd", f"{f}_{x}h2d", f"{f}_{f}_{f}")


QKV_LAYOUTS: tuple[str, ...] = tuple(name for f in QKV_FORMATS for name in _names(f))


def _describe_layouts() -> dict[str, str]:
    """One line per layout: the buffer to allocate and the views to take of it."""
    table = {}
    for f in QKV_FORMATS:
        x = _TOKENS[f]
        dims = ", ".join(x)
        lead = ", ".join(":" for _ in x)
        q_dense = f"q = empty({dims}, h, d)"
        table[f"{x}3hd"] = f"qkv = empty({dims}, 3, h, d); q, k, v = qkv[{lead}, i] (i = 0, 1, 2)"
        table[f"{x}h3d"] = (
            f"qkv = empty({dims}, h, 3, d); q, k, v = qkv[{lead}, :, i] (i = 0, 1, 2)"
        )
        table[f"{f}_{x}2hd"] = (
            f"{q_dense}; kv = empty({dims}, 2, hg, d); k, v = kv[{lead}, i] (i = 0, 1)"
        )
        table[f"{f}_{x}h2d"] = (
            f"{q_dense}; kv = empty({dims}, hg, 2, d); k, v = kv[{lead}, :, i] (i = 0, 1)"
        )
        table[f"{f}_{f}_{f}"] = (
            f"q, k, v each contiguous: [{dims}, h, d], [{dims}, hg, d], [{dims}, hg, d_v]"
        )
    table[STRIDED] = (
        f"{STRIDED}_<q>_<k>_<v>: any other strides, e.g. q, k, v split along the heads of one "
        "projection output (TE issue 1195); each part is the format if that tensor is dense, "
        "else 'view'"
    )
    return table


LAYOUT_DESCRIPTIONS: dict[str, str] = _describe_layouts()


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _packed_views(shape, n: int, before_heads: bool) -> tuple[tuple[int, ...], int]:
    """(strides, offset step) of views `buf[..., i, ...]` of a contiguous packed buffer.

    `shape` is one view's shape `[*tokens, h, d]`; the buffer inserts a dim of size `n` before
    the heads (`3hd`/`2hd`) or before the head dim (`h3d`/`h2d`). View `i` starts `i * step`
    elements after the buffer.
    """
    axis = len(shape) - (2 if before_heads else 1)
    buf_strides = _contiguous_strides((*shape[:axis], n, *shape[axis:]))
    return buf_strides[:axis] + buf_strides[axis + 1 :], buf_strides[axis]


def _strides_match(t: torch.Tensor, strides, exact: bool) -> bool:
    if exact:
        return t.stride() == tuple(strides)
    # Size-0/1 dims address no memory beyond index 0, so their strides are free.
    return all(s == e for n, s, e in zip(t.shape, t.stride(), strides) if n > 1)


def _is_dense(t: torch.Tensor, exact: bool) -> bool:
    return _strides_match(t, _contiguous_strides(t.shape), exact)


def _same_storage(*tensors: torch.Tensor) -> bool:
    ptr = tensors[0].untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == ptr for t in tensors[1:])


def _packed_match(tensors, before_heads: bool, exact: bool) -> bool:
    """Are `tensors` views 0, 1, ... of one contiguous buffer packed at the given axis?"""
    first = tensors[0]
    if not _same_storage(*tensors) or any(t.shape != first.shape for t in tensors):
        return False
    strides, step = _packed_views(first.shape, len(tensors), before_heads)
    base = first.storage_offset()
    return all(
        t.storage_offset() == base + i * step and _strides_match(t, strides, exact)
        for i, t in enumerate(tensors)
    )


def _match(q, k, v, f: str, exact: bool) -> str | None:
    """The first of `f`'s five layouts that q, k, v are in (TE's order), or None."""
    packed3, packed3h, packed2, packed2h, separate = _names(f)
    if _packed_match((q, k, v), before_heads=True, exact=exact):
        return packed3
    if _packed_match((q, k, v), before_heads=False, exact=exact):
        return packed3h
    if not _is_dense(q, exact):
        return None
    if _packed_match((k, v), before_heads=True, exact=exact):
        return packed2
    if _packed_match((k, v), before_heads=False, exact=exact):
        return packed2h
    if _is_dense(k, exact) and _is_dense(v, exact):
        return separate
    return None


def _check(q, k, v, qkv_format: str) -> None:
    if qkv_format not in QKV_FORMATS:
        raise ArgumentError(f"qkv_format={qkv_format!r} is not one of {', '.join(QKV_FORMATS)}")
    rank = len(qkv_format)
    named = (("query_layer", q), ("key_layer", k), ("value_layer", v))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ArgumentError(
                f"{name} must be {rank}-D for qkv_format={qkv_format!r} "
                f"([{', '.join(qkv_format)}]), got shape {tuple(t.shape)}"
            )
    # thd keeps its batch in cu_seqlens: only the k/v token counts below can be compared.
    batch = {"sbhd": 1, "bshd": 0}.get(qkv_format)
    if batch is not None:
        for name, t in named[1:]:
            if t.shape[batch] != q.shape[batch]:
                raise ArgumentError(
                    f"{name} batch size {t.shape[batch]} (dim {batch} of shape "
                    f"{tuple(t.shape)}) differs from query_layer's {q.shape[batch]} (shape "
                    f"{tuple(q.shape)}) for qkv_format={qkv_format!r}"
                )
    seq = qkv_format.index("t" if qkv_format == "thd" else "s")
    if k.shape[seq] != v.shape[seq]:
        raise ArgumentError(
            f"value_layer length {v.shape[seq]} (dim {seq} of shape {tuple(v.shape)}) differs "
            f"from key_layer's {k.shape[seq]} (shape {tuple(k.shape)}) for "
            f"qkv_format={qkv_format!r}"
        )


def get_qkv_layout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str = "sbhd"
) -> str:
    """Name the memory layout of q, k, v (shapes per format in the module docstring).

    Returns one of `QKV_LAYOUTS` when every stride and storage offset is that layout's, else
    `strided_<q>_<k>_<v>` (never one of the 15). Reads metadata only: no copy, no sync.

    Raises:
        ValueError: unknown `qkv_format`; a tensor of the wrong rank; batch sizes of q, k, v that
            differ (sbhd/bshd); k and v of different sequence lengths (token counts for thd).
        TypeError: an argument that is not a tensor.
    """
    _check(q, k, v, qkv_format)
    for exact in (True, False):
        name = _match(q, k, v, qkv_format, exact)
        if name is not None:
            return name
    parts = (qkv_format if _is_dense(t, exact=False) else "view" for t in (q, k, v))
    return "_".join((STRIDED, *parts))


def kernel_ready(t: torch.Tensor, name: str = "tensor") -> str | None:
    """None when the kernels can read `t` in place, else why a contiguous copy is needed.

    The kernels take any per-dim strides but load each head vector as one contiguous run, so the
    only requirement is a unit stride in the last (head) dim; a size-1 head dim has no stride.
    """
    if t.shape[-1] <= 1 or t.stride(-1) == 1:
        return None
    return f"{name}: stride(-1)={t.stride(-1)} != 1"


__all__ = [
    "LAYOUT_DESCRIPTIONS",
    "QKV_LAYOUTS",
    "STRIDED",
    "get_qkv_layout",
    "kernel_ready",
]
