"""Host-side logic of the sm_90 forward path, on the CPU: which storage its TMA grid can read in
place (`tma_view`), and that the dispatcher never picks it off an sm_90 GPU.

Shapes: dense [b, s, h, d] views (bshd order, any strides), varlen [t, h, d].
"""

from __future__ import annotations

import pytest
import torch
from fusedlayers.kernels import _flash_fwd_sm90 as sm90
from fusedlayers.kernels import dispatch, set_forward_path
from fusedlayers.kernels._common import launch_geometry


def _origin(t, z, h, view, varlen=False):
    """(row, col) of head h of sequence z in the TMA grid, as the kernel computes it."""
    stride_b = 0 if varlen else t.stride(0)
    stride_h = t.stride(-2)
    width = view[0][1]
    base = z * stride_b + h * stride_h
    return base // width, base % width


def _check_grid(t, varlen=False):
    """Every element of t sits where the grid says: row-major index row * width + col."""
    view = sm90.tma_view(t, varlen, 16)
    assert view is not None
    (rows, width), (pitch, one) = view
    assert pitch == width and one == 1
    flat = t.untyped_storage()
    base_ptr = t.data_ptr()
    batches = 1 if varlen else t.shape[0]
    seq = t.shape[0] if varlen else t.shape[1]
    for z in range(batches):
        for h in range(t.shape[-2]):
            row, col = _origin(t, z, h, view, varlen)
            assert col + t.shape[-1] <= width
            assert row + seq <= rows
            expected = t[:, h] if varlen else t[z, :, h]
            # element (row + i, col + j) of the grid is storage element base + (row+i)*width + col+j
            got = torch.as_strided(
                torch.empty(0, dtype=t.dtype).set_(flat),
                (seq, t.shape[-1]),
                (width, 1),
                (base_ptr - flat.data_ptr()) // t.element_size() + row * width + col,
            )
            assert torch.equal(got, expected)


def test_tma_view_covers_common_layouts():
    x = torch.randn(2, 33, 3, 64)
    _check_grid(x)  # bshd
    _check_grid(torch.randn(33, 2, 3, 64).transpose(0, 1))  # sbhd
    qkv = torch.randn(33, 2, 3, 3, 64)  # sb3hd
    for i in range(3):
        _check_grid(qkv[:, :, i].transpose(0, 1))
    kv = torch.randn(2, 33, 2, 3, 64)  # bs2hd
    _check_grid(kv[:, :, 1])
    fused = torch.randn(2, 33, 3 + 2 * 1, 64)  # GQA heads split from one projection
    _check_grid(fused[:, :, :3])
    _check_grid(fused[:, :, 3:4])
    _check_grid(torch.randn(50, 3, 64), varlen=True)  # thd


def test_tma_view_rejects_what_tma_cannot_read():
    rows_196 = torch.randn(2, 33, 196, dtype=torch.float16)[..., :192].unflatten(-1, (3, 64))
    assert sm90.tma_view(rows_196, False, 16) is None  # row pitch 392 bytes: not 16-aligned
    rows_200 = torch.randn(2, 33, 200, dtype=torch.float16)[..., :192].unflatten(-1, (3, 64))
    assert sm90.tma_view(rows_200, False, 16) is not None  # 400 bytes: aligned
    base = torch.randn(2 * 33 * 3 * 64 + 1)[1:].view(2, 33, 3, 64)
    assert sm90.tma_view(base, False, 16) is None  # misaligned base
    # Heads farther apart than one sequence row: head 1 would wrap into the next grid row.
    odd = torch.randn(2, 3, 33, 64).transpose(1, 2)  # bhsd storage viewed as bshd
    assert sm90.tma_view(odd, False, 16) is None
    assert sm90.tma_view(torch.randn(2, 33, 3, 64).transpose(-1, -2), False, 16) is None


def test_tma_view_never_reaches_past_the_storage():
    """A grid shorter than one box would make TMA read the memory behind the tensor (zeros come
    only past the grid's end), which faults where that memory is unmapped: an H200 run crashed
    with an illegal address. Such tensors get no grid (the portable kernels take the call),
    unless the caller vouches for one box of storage (`storage_rows`)."""
    x = torch.randn(2, 33, 3, 64)  # 66 rows of the grid, batch entries one after the other
    assert sm90.tma_view(x, False, 66)[0] == [66, 192]
    assert sm90.tma_view(x, False, 67) is None
    assert sm90.tma_view(x[:, :1], False, 64) is None  # a decode-like q: 2 rows
    assert sm90.tma_view(torch.randn(40, 3, 64), True, 64) is None  # 40 tokens, varlen
    assert sm90.tma_view(x, False, 128, storage_rows=128)[0] == [128, 192]
    assert sm90.tma_view(x, False, 128, storage_rows=100) is None
    q, k = (
        torch.randn(1, 63, 2, 64, dtype=torch.float16),
        torch.randn(1, 2048, 2, 64, dtype=torch.float16),
    )
    assert sm90.plan_views(q, k, k, False) is None  # 63 query rows: under one 64-row box
    assert sm90.plan_views(torch.randn(1, 64, 2, 64, dtype=torch.float16), k, k, False) is not None


def test_dispatcher_never_picks_sm90_off_the_gpu():
    q = torch.randn(1, 256, 2, 128, dtype=torch.float16)
    geom = launch_geometry(q, q)
    previous = set_forward_path("sm90")
    try:
        plan = dispatch.sm90_forward_plan(
            q, q, q, geom, window_left=-1, window_right=-1, bias=None, alibi_slopes=None,
            softcap=0.0, dropout_p=0.0,
        )  # fmt: skip
    finally:
        set_forward_path(previous)
    assert plan is None


@pytest.mark.parametrize(
    "d,keys,causal,taken",
    [
        (128, 1024, False, True),  # SM90_MIN_KEYS
        (128, 1023, False, False),
        (128, 1024, True, True),
        (128, 1023, True, False),
        (64, 2048, False, True),
        (64, 2047, False, False),
        (64, 1024, True, True),  # SM90_MIN_KEYS_CAUSAL
        (64, 1023, True, False),
        (64, 1024, False, False),
    ],
)
def test_auto_takes_sm90_from_the_measured_lengths(d, keys, causal, taken, monkeypatch):
    """ "auto" on an sm_90 GPU (faked here) takes the sm_90 forward from the key length its
    tables give, one for calls without a mask and one for causal calls (d=64 from 2k and from
    1k); the rest fall back."""
    if not sm90.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(dispatch, "_on_sm90", lambda t: True)
    q = torch.randn(1, 64, 2, d, dtype=torch.float16)
    k = torch.randn(1, keys, 2, d, dtype=torch.float16)
    geom = launch_geometry(q, k)
    plan = dispatch.sm90_forward_plan(
        q, k, k, geom, window_left=-1, window_right=0 if causal else -1, bias=None,
        alibi_slopes=None, softcap=0.0, dropout_p=0.0,
    )  # fmt: skip
    assert (plan is not None) == taken


def test_descriptor_maker_makes_what_the_constructor_makes():
    """A plan's descriptor maker (`descriptor_maker`) checks once and then only puts each call's
    tensor into the checked fields: its descriptors must equal the constructor's for another
    tensor of the same signature, and it must keep no reference to the tensor it was made
    from (a plan outlives its first call's tensors)."""
    import gc
    import weakref

    from fusedlayers.kernels import _sm90_common

    if not _sm90_common.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    first = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    view = _sm90_common.tma_view(first, False, 128)
    make = _sm90_common.descriptor_maker(first, view, [128, 64])
    alive = weakref.ref(first)
    del first
    gc.collect()
    assert alive() is None, "the maker keeps its first tensor alive"
    other = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    made = make(other)
    layout = _sm90_common._smem_layout(128, 64, torch.bfloat16)
    built = _sm90_common.TensorDescriptor(other, *view, [128, 64], layout)
    assert type(made) is type(built) and made.base is other
    fields = lambda d: {k: v for k, v in vars(d).items() if k != "base"}  # noqa: E731
    assert fields(made) == fields(built)
    assert make(other) is not made  # one descriptor per call


def test_sm90_common_exports_only_what_it_defines(monkeypatch):
    """`_sm90_common.__all__` names only what exists, with Gluon and without it (then only the
    host side), so a star import never fails on an install without Gluon."""
    import importlib.util
    import sys

    from fusedlayers.kernels import _sm90_common

    assert all(hasattr(_sm90_common, name) for name in _sm90_common.__all__)
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)  # its import now fails
    spec = importlib.util.spec_from_file_location(  # in the package: its relative imports
        "fusedlayers.kernels.sm90_common_without_gluon", _sm90_common.__file__
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.GLUON_AVAILABLE
    assert set(module.__all__) == {
        "GLUON_AVAILABLE", "tma_view", "launch_binding", "_smem_layout", "descriptor_maker",
        "tile_width",
    }  # fmt: skip
    assert all(hasattr(module, name) for name in module.__all__)


def _recorded_sm90_launches(monkeypatch, calls):
    """Run `forward_sm90` on CPU tensors for each (q, k, v, causal, signature) of `calls`, with
    its launch recorded instead of made: [(grid, positional args, keywords)]."""
    if not sm90.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    launches = []
    record = lambda kernel, grid, *args, **kw: launches.append((grid, args, kw))  # noqa: E731
    monkeypatch.setattr(sm90, "launch", record)
    monkeypatch.setattr(sm90, "tile_counter", lambda device: "counter")
    for q, k, v, causal, signature in calls:
        geom = launch_geometry(q, k)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
        sm90.forward_sm90(
            q, k, v, out, lse, geom, softmax_scale=0.125, causal=causal, bottom_right=True,
            signature=signature,
        )  # fmt: skip
    return launches


def _qkv(s=256, h=4, h_kv=2, d=64, transpose=False):
    q, k, v = (torch.randn(2, s, n, d, dtype=torch.float16) for n in (h, h_kv, h_kv))
    if transpose:  # the same shapes over sbhd storage: other strides
        q, k, v = (torch.randn(t.shape[1], 2, *t.shape[2:], dtype=t.dtype).transpose(0, 1)
                   for t in (q, k, v))  # fmt: skip
    return q, k, v


@pytest.fixture
def sm90_plans(monkeypatch):
    monkeypatch.setattr(sm90, "_PLANS", {})
    return sm90._PLANS


def test_sm90_launch_plan_is_made_once_per_signature(monkeypatch, sm90_plans):
    """With a signature the launch's grid, integers and constexprs come from a plan made once
    (and the launch gets a slot); they equal what a call without a signature computes afresh,
    and the tile counter is passed for causal launches only."""
    a, b = _qkv(), _qkv()
    calls = [(*a, True, ("sig", 1)), (*b, True, ("sig", 1)), (*b, True, None), (*b, False, None)]
    launches = _recorded_sm90_launches(monkeypatch, calls)
    assert len(sm90_plans) == 1
    (g1, a1, k1), (g2, a2, k2), (g3, a3, k3), (_, a4, _) = launches
    assert k1["slot"] is k2["slot"] is not None and k3["slot"] is None
    assert g1 == g2 == g3 and k1 == k2
    assert {n: x for n, x in k1.items() if n not in ("slot", "signature")} == {
        n: x for n, x in k3.items() if n not in ("slot", "signature")
    }
    # Descriptors and tensors are per call; every integer and float is the plan's or the call's.
    scalars = [[x for x in args if isinstance(x, (int, float, str))] for args in (a1, a2, a3)]
    assert scalars[0] == scalars[1] == scalars[2]
    assert a2[3] is not a1[3]  # this call's out
    assert a1[-1] == "counter" and a4[-1] is None


@pytest.mark.parametrize("change", ["strides", "causal", "settings"])
def test_sm90_launch_plan_follows_its_key(monkeypatch, sm90_plans, change):
    """Another signature, mask or module setting makes another plan, with its own values."""
    first = (*_qkv(), True, ("sig", 1))
    second = (*_qkv(), True, ("sig", 1))
    if change == "strides":
        second = (*_qkv(transpose=True), True, ("sig", 2))
    elif change == "causal":
        second = (*_qkv(), False, ("sig", 1))
    launches = _recorded_sm90_launches(monkeypatch, [first])
    if change == "settings":  # the one-tile grid for causal d = 64
        monkeypatch.setitem(sm90.PERSISTENT_CAUSAL, 64, False)
    launches += _recorded_sm90_launches(monkeypatch, [second])
    (_, a1, k1), (_, a2, k2) = launches
    assert len(sm90_plans) == 2 and k1["slot"] is not k2["slot"]
    if change == "strides":
        assert a1[11:26] != a2[11:26]
    elif change == "causal":
        assert k1["IS_CAUSAL"] and not k2["IS_CAUSAL"]
    else:
        assert k1["PERSISTENT"] and not k2["PERSISTENT"]
