"""Layout detection: every TE layout built as TE's tests build it, the issue-1195 views, and
property tests that a returned name is a true claim about every stride and offset.

The oracle is `claim_holds`: it rebuilds the views a layout name describes from nothing but the
storage, the shapes and the start of each buffer, and compares them with the tensors given. It
parses the name, so it shares no code with `fusedlayers.attention.layouts`.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedlayers.attention.layouts import (
    LAYOUT_DESCRIPTIONS,
    QKV_LAYOUTS,
    STRIDED,
    get_qkv_layout,
    kernel_ready,
)
from fusedlayers.attention.reference import attention_reference

FORMATS = ("sbhd", "bshd", "thd")
# TE's names per format (its get_qkv_layout docstring), written out rather than derived.
TE_LAYOUTS = {
    "sbhd": ("sb3hd", "sbh3d", "sbhd_sb2hd", "sbhd_sbh2d", "sbhd_sbhd_sbhd"),
    "bshd": ("bs3hd", "bsh3d", "bshd_bs2hd", "bshd_bsh2d", "bshd_bshd_bshd"),
    "thd": ("t3hd", "th3d", "thd_t2hd", "thd_th2d", "thd_thd_thd"),
}
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
# (b, s_q, s_kv, d); thd packs b sequences into t tokens, of the lengths `_lengths` gives.
SHAPES = ((2, 6, 6, 8), (1, 5, 9, 16))


def _lengths(b: int, s_q: int, s_kv: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """thd sequence lengths (q, kv): `b` sequences of at most `s_q` / `s_kv` tokens, unequal."""
    return tuple(tuple(max(1, s - 3 * i) for i in range(b)) for s in (s_q, s_kv))


def _unique(shape, dtype=torch.float64) -> torch.Tensor:
    """Random values, all distinct, so equal values mean the same memory was read."""
    n = 1
    for size in shape:
        n *= size
    return (torch.randperm(n, dtype=dtype) + 1).reshape(shape) / n


def _dims(b: int, s: int, t: int, h: int, d: int) -> dict[str, int]:
    return {"s": s, "b": b, "t": t, "h": h, "d": d, "2": 2, "3": 3}


def build(layout: str, b, s_q, s_kv, h, hg, d, alloc=_unique) -> tuple[torch.Tensor, ...]:
    """q, k, v in `layout`, the way TE's tests make them: one buffer per `_` chunk of the name
    (`alloc(shape)`), split along its digit dim. The first chunk has the query sizes, the
    others the KV sizes."""
    t_q, t_kv = (sum(lengths) for lengths in _lengths(b, s_q, s_kv))
    tensors = []
    for i, chunk in enumerate(layout.split("_")):
        sizes = _dims(b, s_q, t_q, h, d) if i == 0 else _dims(b, s_kv, t_kv, hg, d)
        buf = alloc([sizes[c] for c in chunk])
        digit = next((p for p, c in enumerate(chunk) if c.isdigit()), None)
        if digit is None:
            tensors.append(buf)
        else:
            tensors.extend(part.squeeze(digit) for part in buf.split(1, dim=digit))
    return tuple(tensors)


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return strides


def claim_holds(name: str, q, k, v) -> bool:
    """Do q, k, v read exactly the memory `name` says, given only storage, shapes, and the
    storage offset of the first tensor of each buffer?"""
    tensors, start = (q, k, v), 0
    for chunk in name.split("_"):
        digit = next((p for p, c in enumerate(chunk) if c.isdigit()), None)
        n = 1 if digit is None else int(chunk[digit])
        group, start = tensors[start : start + n], start + n
        first = group[0]
        if any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in group):
            return False
        if any(t.shape != first.shape for t in group):
            return False
        shape = list(first.shape)
        if digit is not None:
            shape.insert(digit, n)
        strides = _contiguous_strides(shape)
        step = 0 if digit is None else strides.pop(digit)
        for i, t in enumerate(group):
            try:
                rebuilt = first.as_strided(t.shape, strides, first.storage_offset() + i * step)
            except RuntimeError:  # the claimed views would run past the storage
                return False
            if not torch.equal(rebuilt, t):
                return False
    return start == 3


def _to_reference(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return t.transpose(0, 1) if fmt == "sbhd" else t  # a view: the reference reads the strides


def _cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor((0, *itertools.accumulate(lengths)), dtype=torch.int32)


def _attend(q, k, v, fmt: str, lengths) -> torch.Tensor:
    """Causal attention through the reference; `lengths` (q, kv) only matter for thd."""
    kw = dict(window_size=(-1, 0), bottom_right=False)
    if fmt == "thd":
        kw.update(cu_seqlens_q=_cu_seqlens(lengths[0]), cu_seqlens_kv=_cu_seqlens(lengths[1]))
    return attention_reference(*(_to_reference(t, fmt) for t in (q, k, v)), **kw)


def _assert_same_attention(q, k, v, fmt: str, lengths) -> None:
    out = _attend(q, k, v, fmt, lengths)
    want = _attend(q.contiguous(), k.contiguous(), v.contiguous(), fmt, lengths)
    assert out.abs().max() > 0
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def _layout_cases():
    for fmt, heads, shape in itertools.product(FORMATS, HEADS, SHAPES):
        h, hg = HEADS[heads]
        b, s_q, s_kv, d = shape
        for name in TE_LAYOUTS[fmt]:
            if "3" in name and (h != hg or s_q != s_kv):
                continue  # one [.., 3, h, d] buffer holds q, k and v: same heads and lengths
            yield pytest.param(name, fmt, heads, shape, id=f"{name}-{heads}-b{b}s{s_q}x{s_kv}")


@pytest.mark.parametrize("layout, fmt, heads, shape", list(_layout_cases()))
def test_every_te_layout_is_named_and_read_in_place(layout, fmt, heads, shape):
    b, s_q, s_kv, d = shape
    h, hg = HEADS[heads]
    q, k, v = build(layout, b, s_q, s_kv, h, hg, d)
    assert get_qkv_layout(q, k, v, fmt) == layout
    assert claim_holds(layout, q, k, v)
    assert all(kernel_ready(t) is None for t in (q, k, v))
    _assert_same_attention(q, k, v, fmt, _lengths(b, s_q, s_kv))


def test_names_are_te_vocabulary_and_described():
    assert QKV_LAYOUTS == tuple(name for fmt in FORMATS for name in TE_LAYOUTS[fmt])
    assert set(LAYOUT_DESCRIPTIONS) == set(QKV_LAYOUTS) | {STRIDED}
    assert not any(name.startswith(STRIDED) for name in QKV_LAYOUTS)


def _token_shape(fmt: str, b: int, s: int) -> list[int]:
    return {"sbhd": [s, b], "bshd": [b, s], "thd": [b * s]}[fmt]


def issue_1195_views(fmt: str, b, s, h, hg, d, grouped: bool, alloc=_unique):
    """q, k, v as TE's MultiheadAttention makes them from one fused projection output.

    Not grouped: `[*tokens, h + 2*hg, d]` split along the heads (the issue's reproducer).
    Grouped (interleaved weights): `[*tokens, hg, h/hg + 2, d]`, q = the first h/hg of each
    group (a reshape, which copies unless hg == 1), k and v the last two.
    """
    tokens = _token_shape(fmt, b, s)
    if not grouped:
        return alloc([*tokens, h + 2 * hg, d]).split([h, hg, hg], dim=-2)
    g = h // hg
    groups = alloc([*tokens, hg, g + 2, d])
    return groups[..., :g, :].reshape(*tokens, h, d), groups[..., g, :], groups[..., g + 1, :]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("hg", (1, 4))
@pytest.mark.parametrize("grouped", (False, True), ids=("split", "grouped"))
def test_issue_1195_head_split_views_are_not_dense(fmt, hg, grouped):
    b, s, h, d = 2, 7, 16, 8
    q, k, v = issue_1195_views(fmt, b, s, h, hg, d, grouped)
    dense = TE_LAYOUTS[fmt][-1]
    name = get_qkv_layout(q, k, v, fmt)
    assert name != dense and name not in QKV_LAYOUTS
    assert name.startswith(STRIDED + "_") and name.endswith("_view_view")
    # The oracle sees the bug TE had: the dense claim reads other memory than these views.
    assert not claim_holds(dense, q, k, v)
    lengths = ((s,) * b,) * 2
    _assert_same_attention(q, k, v, fmt, lengths)


def test_equal_head_splits_are_the_packed_layouts():
    """With h == hg a head split of one projection reads exactly a packed buffer's views: the
    name follows the memory, not how the views were made."""
    s, b, h, d = 5, 2, 4, 8
    assert get_qkv_layout(*_unique([s, b, 3 * h, d]).split(h, dim=2), "sbhd") == "sb3hd"
    kv = _unique([b, s, 2 * h, d]).split(h, dim=2)
    assert get_qkv_layout(_unique([b, s, h, d]), *kv, "bshd") == "bshd_bs2hd"


def test_packed_buffer_inside_a_larger_allocation_keeps_its_name():
    """Offsets count from the buffer's start, wherever it sits in its storage."""
    s, b, h, d = 5, 2, 3, 4
    pool = _unique([7 + s * b * 3 * h * d + 11])
    qkv = pool[7 : 7 + s * b * 3 * h * d].view(s, b, 3, h, d)
    assert get_qkv_layout(*qkv.unbind(2), "sbhd") == "sb3hd"
    q = _unique([s * b, h, d])
    kv = pool[7 : 7 + s * b * h * 2 * d].view(s * b, h, 2, d)
    assert get_qkv_layout(q, *kv.unbind(2), "thd") == "thd_th2d"


def test_back_to_back_in_one_allocation_is_dense_and_size_one_strides_are_free():
    s, b, h, hg, d = 4, 3, 4, 2, 8
    flat = _unique([s * b * (h + 2 * hg) * d])
    q, k, v = flat.split([s * b * h * d, s * b * hg * d, s * b * hg * d])
    q, k, v = q.view(b, s, h, d), k.view(b, s, hg, d), v.view(b, s, hg, d)
    assert get_qkv_layout(q, k, v, "bshd") == "bshd_bshd_bshd"
    # A batch-1 bshd tensor transposed to sbhd reads dense memory; only the size-1 stride differs.
    q1, k1, v1 = (_unique([1, s, n, d]).transpose(0, 1) for n in (h, hg, hg))
    assert q1.stride() != tuple(_contiguous_strides(q1.shape))
    assert get_qkv_layout(q1, k1, v1, "sbhd") == "sbhd_sbhd_sbhd"


@pytest.mark.parametrize(
    "make",
    [
        # q, k, v of one sb3hd buffer in another order: the name would claim k is at +h*d.
        lambda buf: (buf[:, :, 1], buf[:, :, 0], buf[:, :, 2]),
        # k and v swapped inside the kv buffer.
        lambda buf: (buf[:, :, 0].contiguous(), buf[:, :, 2], buf[:, :, 1]),
        # an MQA key broadcast over the heads (stride 0) is no dense tensor.
        lambda buf: (
            buf[:, :, 0].contiguous(),
            buf[:, :, 1, :1].expand(-1, -1, 3, -1),
            buf[:, :, 2].contiguous(),
        ),
        # every other token of a dense tensor.
        lambda buf: tuple(t.contiguous()[::2] for t in buf.unbind(2)),
        # a head dim read with stride 2.
        lambda buf: tuple(t.contiguous()[..., ::2] for t in buf.unbind(2)),
        # dense strides but the head dim's: heads overlap. Only the inner stride is wrong.
        lambda buf: tuple(buf.as_strided((6, 2, 3, 4), (24, 12, 4, 2), i * 200) for i in range(3)),
    ],
    ids=("qkv-permuted", "kv-swapped", "expanded-k", "token-step", "head-dim-step", "overlap"),
)
def test_near_misses_are_strided(make):
    q, k, v = make(_unique([6, 2, 3, 3, 8]))
    name = get_qkv_layout(q, k, v, "sbhd")
    assert name.startswith(STRIDED + "_")
    assert not any(claim_holds(n, q, k, v) for n in TE_LAYOUTS["sbhd"])
    _assert_same_attention(q, k, v, "sbhd", None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_views_of_different_buffers_are_not_packed(fmt):
    """Strides and offsets of `x3hd`/`x2hd` views, but each from its own buffer: not one chunk."""
    tokens = _token_shape(fmt, 2, 3)
    q, k, v = (_unique([*tokens, 3, 2, 8]).select(-3, i) for i in range(3))
    assert get_qkv_layout(q, k, v, fmt) == "_".join((STRIDED, "view", "view", "view"))
    q = _unique([*tokens, 2, 8])
    k, v = (_unique([*tokens, 2, 2, 8]).select(-3, i) for i in range(2))
    assert get_qkv_layout(q, k, v, fmt) == "_".join((STRIDED, fmt, "view", "view"))
    assert not any(claim_holds(n, q, k, v) for n in TE_LAYOUTS[fmt])


def _order(draw, n: int) -> list[int]:
    """range(n), shuffled half of the time (so that every layout also comes out unshuffled)."""
    return draw(st.one_of(st.just(list(range(n))), st.permutations(range(n))))


def _alloc(draw, shape) -> torch.Tensor:
    """A tensor of `shape` in a random memory order, possibly narrowed out of a wider one along
    a random dim, at a random offset in its storage."""
    order = _order(draw, len(shape))
    wide = list(shape)
    narrow_dim = draw(st.one_of(st.none(), st.none(), st.sampled_from(range(len(shape)))))
    extra = draw(st.integers(1, 2)) if narrow_dim is not None else 0
    if narrow_dim is not None:
        wide[narrow_dim] += extra
    numel = 1
    for size in wide:
        numel *= size
    pad = draw(st.integers(0, 3))
    stored = _unique([pad + numel])[pad:].view([wide[i] for i in order])
    t = stored.permute([order.index(i) for i in range(len(shape))])
    if narrow_dim is not None:
        t = t.narrow(narrow_dim, draw(st.integers(0, extra)), shape[narrow_dim])
    return t


def _any_strides(draw, pool: torch.Tensor, shape) -> torch.Tensor:
    """A view of `pool` with each stride dense or random (gaps, overlaps, zero strides)."""
    strides = [draw(st.one_of(st.just(e), st.integers(0, 5))) for e in _contiguous_strides(shape)]
    return pool.as_strided(shape, strides, draw(st.integers(0, 8)))


KINDS = ("packed3", "packed2", "split", "grouped", "separate", "as_strided")


@st.composite
def qkv_views(draw):
    """(fmt, q, k, v): packed buffers, head splits, grouped splits or separate tensors, each
    allocated in a random memory order, with views taken in a random order; or views of one
    pool with random strides."""
    fmt = draw(st.sampled_from(FORMATS))
    kind = draw(st.sampled_from(KINDS))
    b, s, s_kv = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    hg, g, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    if kind in ("packed3", "split", "grouped"):
        s_kv = s  # q, k and v come out of one buffer
    if kind == "packed3":
        g = 1
    h, tokens, tokens_kv = hg * g, _token_shape(fmt, b, s), _token_shape(fmt, b, s_kv)
    if kind in ("packed3", "packed2"):
        n = 3 if kind == "packed3" else 2
        axis = len(tokens) + draw(st.integers(0, 1))  # [.., n, h, d] or [.., h, n, d]
        shape = [*tokens_kv, hg, d]
        buf = _alloc(draw, shape[:axis] + [n] + shape[axis:])
        views = [buf.select(axis, i) for i in _order(draw, n)]
        return (fmt, *views) if n == 3 else (fmt, _alloc(draw, [*tokens, h, d]), *views)
    if kind == "split":
        order = _order(draw, 3)
        sizes = [(h, hg, hg)[i] for i in order]
        parts = _alloc(draw, [*tokens, h + 2 * hg, d]).split(sizes, dim=-2)
        return (fmt, *(parts[order.index(i)] for i in range(3)))
    if kind == "grouped":
        groups = _alloc(draw, [*tokens, hg, g + 2, d])
        return fmt, groups[..., :g, :].reshape(*tokens, h, d), groups[..., g, :], groups[..., -1, :]
    return fmt, *(
        _alloc(draw, [*t, n, d]) for t, n in ((tokens, h), (tokens_kv, hg), (tokens_kv, hg))
    )


def _dense_alone(t: torch.Tensor) -> bool:
    return torch.equal(t.as_strided(t.shape, _contiguous_strides(t.shape), t.storage_offset()), t)


@settings(max_examples=400, deadline=None)
@given(qkv_views())
def test_a_name_is_a_true_claim_and_strided_means_no_name_fits(case):
    fmt, q, k, v = case
    name = get_qkv_layout(q, k, v, fmt)
    if name in QKV_LAYOUTS:
        assert name in TE_LAYOUTS[fmt]
        assert claim_holds(name, q, k, v), (name, [t.stride() for t in (q, k, v)])
    else:
        assert not any(claim_holds(n, q, k, v) for n in TE_LAYOUTS[fmt]), name
        parts = [fmt if _dense_alone(t) else "view" for t in (q, k, v)]
        assert name == "_".join((STRIDED, *parts))


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from((*FORMATS, "bhsd", "")),
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=3, max_size=3),
)
def test_any_shapes_give_a_name_or_a_value_error(fmt, shapes):
    tensors = [torch.randn(shape).transpose(0, -1) for shape in shapes]
    try:
        name = get_qkv_layout(*tensors, fmt)
    except ValueError:
        return
    assert name in QKV_LAYOUTS or name.startswith(STRIDED + "_")


def _qkv(fmt: str, b=2, s=3, s_kv=3, h=4, hg=2, d=8):
    tokens, tokens_kv = _token_shape(fmt, b, s), _token_shape(fmt, b, s_kv)
    return _unique([*tokens, h, d]), _unique([*tokens_kv, hg, d]), _unique([*tokens_kv, hg, d])


@pytest.mark.parametrize("fmt", ("bhsd", "sbh3d", "SBHD", ""))
def test_unknown_format_is_a_value_error(fmt):
    with pytest.raises(ValueError, match=rf"qkv_format={fmt!r} is not one of sbhd, bshd, thd"):
        get_qkv_layout(*_qkv("sbhd"), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("which", (0, 1, 2))
def test_wrong_rank_names_the_argument_and_its_shape(fmt, which):
    tensors = list(_qkv(fmt))
    tensors[which] = tensors[which].unsqueeze(0)
    name = ("query_layer", "key_layer", "value_layer")[which]
    shape = re.escape(str(tuple(tensors[which].shape)))
    with pytest.raises(ValueError, match=rf"{name} must be {len(fmt)}-D .*shape {shape}"):
        get_qkv_layout(*tensors, fmt)


@pytest.mark.parametrize("fmt, batch_dim", (("sbhd", 1), ("bshd", 0)))
@pytest.mark.parametrize("which", (1, 2))
def test_batch_mismatch_names_the_argument_and_its_shape(fmt, batch_dim, which):
    tensors = list(_qkv(fmt))
    tensors[which] = torch.cat([tensors[which]] * 2, dim=batch_dim)
    name = ("key_layer", "value_layer")[which - 1]
    shape = re.escape(str(tuple(tensors[which].shape)))
    with pytest.raises(ValueError, match=rf"{name} batch size 4 .*{shape}.* query_layer's 2"):
        get_qkv_layout(*tensors, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_key_value_length_mismatch_names_both_shapes(fmt):
    q, k, v = _qkv(fmt)
    v = torch.cat([v, v], dim=fmt.index("t" if fmt == "thd" else "s"))
    with pytest.raises(
        ValueError, match=rf"value_layer length .*{tuple(v.shape)}.*{tuple(k.shape)}"
    ):
        get_qkv_layout(q, k, v, fmt)


def test_cross_attention_lengths_are_no_error():
    for fmt in FORMATS:
        assert get_qkv_layout(*_qkv(fmt, s=3, s_kv=5), fmt) == TE_LAYOUTS[fmt][-1]


def test_a_non_tensor_is_a_type_error():
    q, k, v = _qkv("sbhd")
    with pytest.raises(TypeError, match="key_layer must be a torch.Tensor, got list"):
        get_qkv_layout(q, k.tolist(), v)


def test_kernel_ready_asks_only_for_a_unit_inner_stride():
    packed = _unique([5, 2, 3, 4, 8])
    assert all(kernel_ready(t) is None for t in packed.unbind(2))  # packed views: read in place
    inner = _unique([5, 2, 4, 8, 3])[..., 0]  # head dim strided by 3
    assert kernel_ready(inner, "query_layer") == "query_layer: stride(-1)=3 != 1"
    assert kernel_ready(inner.transpose(0, 1)) == "tensor: stride(-1)=3 != 1"
    assert kernel_ready(_unique([5, 2, 4, 3])[..., :1]) is None  # size-1 head dim: no stride
    assert kernel_ready(_unique([8, 5]).t()) == "tensor: stride(-1)=5 != 1"
