"""Host-side logic of the sm_90 backward path, on the CPU: which calls its plan covers, that the
dispatcher never picks it off an sm_90 GPU, the setting's validation, and the storage behind the dQ
accumulator that the kernel's TMA reduce writes into.

Shapes: dense q/dout [b, s, h, d], k/v [b, s, h_kv, d]; lse [b, h, s].
"""

from __future__ import annotations

import pytest
import torch
from fusedlayers.kernels import _flash_bwd_sm90, _flash_fwd_sm90, dispatch, set_backward_path
from fusedlayers.kernels._common import launch_geometry, shape_only_geometry


def _plan(q, k, v, dout, **overrides):
    geom = launch_geometry(q, k)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    options = dict(window_left=-1, window_right=-1, bias=None, alibi_slopes=None, softcap=0.0,
                   dropout_p=0.0, deterministic=False)  # fmt: skip
    options.update(overrides)
    return dispatch.sm90_backward_plan(q, k, v, dout, lse, geom, **options)


def test_dispatcher_never_picks_sm90_off_the_gpu():
    q = torch.randn(1, 256, 2, 128, dtype=torch.float16)
    previous = set_backward_path("sm90")
    try:
        assert _plan(q, q, q, q) is None
    finally:
        set_backward_path(previous)


def test_plan_covers_what_the_kernel_does(monkeypatch):
    """With the GPU check stubbed to pass, the plan takes exactly the covered calls."""
    monkeypatch.setattr(dispatch, "_on_sm90", lambda t: True)
    monkeypatch.setattr(_flash_bwd_sm90, "GLUON_AVAILABLE", True)
    previous = set_backward_path("sm90")
    try:
        q = torch.randn(2, 300, 4, 128, dtype=torch.bfloat16)
        kv = torch.randn(2, 300, 2, 128, dtype=torch.bfloat16)
        views, causal = _plan(q, kv, kv, q, window_right=0)
        assert causal and len(views) == 4
        assert _plan(q, kv, kv, q)[1] is False
        assert _plan(q, kv, kv, q, deterministic=True) is None  # atomics: not reproducible
        assert _plan(q, kv, kv, q, window_left=64, window_right=0) is None
        assert _plan(q, kv, kv, q, softcap=20.0) is None
        assert _plan(q, kv, kv, q, dropout_p=0.1) is None
        assert _plan(q, kv, kv, q, alibi_slopes=torch.ones(2, 4)) is None
        assert _plan(q, kv, kv, q, bias=torch.zeros(2, 4, 300, 300)) is None
        assert _plan(q.float(), kv.float(), kv.float(), q.float()) is None
        q96 = torch.randn(2, 300, 4, 96, dtype=torch.bfloat16)
        assert _plan(q96, q96, q96, q96) is None
        # auto follows the table (None entries mean never) and wants enough programs.
        set_backward_path("auto")
        monkeypatch.setitem(dispatch.SM90_BWD_MIN_KEYS, 128, None)
        assert _plan(q, kv, kv, q) is None
        monkeypatch.setitem(dispatch.SM90_BWD_MIN_KEYS, 128, 256)
        monkeypatch.setattr(dispatch, "SM90_BWD_MIN_WAVES", 0)
        assert _plan(q, kv, kv, q) is not None
        assert _plan(q[:, :200], kv[:, :200], kv[:, :200], q[:, :200]) is None  # 200 < 256 keys
        # 3 key blocks x 2 sequences x 2 KV heads = 12 programs: under one wave of the H100.
        monkeypatch.setattr(dispatch, "SM90_BWD_MIN_WAVES", 1)
        assert _plan(q, kv, kv, q) is None
    finally:
        set_backward_path(previous)


@pytest.mark.parametrize(
    "shape",
    [(2, 5, 3, 64), (1, 300, 2, 128), (7, 4, 64), (130, 1, 128), (0, 2, 64)],
    ids=["dense-short", "dense-long", "varlen-short", "varlen-long", "empty"],
)
@pytest.mark.parametrize("zeroed", [True, False], ids=["zeroed", "for-the-preprocess"])
def test_dq_accumulator_has_a_whole_tma_box_behind_it(shape, zeroed):
    # The TMA reduce-add writes whole boxes of DQ_BOX[0] rows wherever the grid allows, and the
    # backward's grid claims at least that many rows (`storage_rows`): the storage must really
    # have them, whether the accumulator comes zero-filled or is left for the preprocess to zero.
    q = torch.randn(shape, dtype=torch.float16)
    acc = _flash_bwd_sm90.dq_accumulator(q, zeroed=zeroed)
    assert acc.shape == q.shape and acc.dtype == torch.float32 and acc.is_contiguous()
    if zeroed:
        assert bool((acc == 0).all())
    row = q.shape[-1] * q.shape[-2]
    storage_rows = acc.untyped_storage().nbytes() // (4 * row)
    rows = q.numel() // row
    assert storage_rows >= max(rows, _flash_bwd_sm90.DQ_BOX[0])
    box = _flash_bwd_sm90.DQ_BOX[0]
    view = _flash_fwd_sm90.tma_view(acc, len(shape) == 3, box, storage_rows=box)
    if rows:
        assert view is not None and view[0][0] <= storage_rows


def test_d64_steps_128_rows_and_64_stays_selectable(monkeypatch):
    """d = 64's backward steps over 128 query rows (`TILES_M128`) in 128-row Q/dO boxes, so it
    takes no q shorter than one box (TMA would read past its storage: `tma_view`);
    `TILES[64] = (64, 2)` selects the 64-row step, whose 64-row boxes take such a q."""
    assert _flash_bwd_sm90.TILES[64] == _flash_bwd_sm90.TILES_M128[64]
    assert _flash_bwd_sm90.TILES_M128[64][0] == 128
    k = torch.randn(1, 300, 2, 64, dtype=torch.bfloat16)
    q = torch.randn(1, 200, 2, 64, dtype=torch.bfloat16)
    views = _flash_bwd_sm90.plan_views(q, k, k, q, False)
    assert views[0][0][0] == 200 and views[3][0][0] == 200  # q and dout: their own rows
    assert views[1][0][0] == 300
    short = torch.randn(1, 100, 2, 64, dtype=torch.bfloat16)
    assert _flash_bwd_sm90.plan_views(short, k, k, short, False) is None
    monkeypatch.setitem(_flash_bwd_sm90.TILES, 64, (64, 2))
    assert _flash_bwd_sm90.plan_views(short, k, k, short, False)[0][0][0] == 100


def _recorded_bwd_launches(monkeypatch, calls):
    """Run `backward_sm90` on CPU tensors for each (d, causal, signature) of `calls`, its launch
    recorded instead of made: [(grid, positional args, keywords)]."""
    if not _flash_bwd_sm90.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    launches = []
    record = lambda kernel, grid, *args, **kw: launches.append((grid, args, kw))  # noqa: E731
    monkeypatch.setattr(_flash_bwd_sm90, "launch", record)
    for d, causal, signature in calls:
        q, k, v, dout = (torch.randn(2, 256, n, d, dtype=torch.float16) for n in (4, 2, 2, 4))
        geom = launch_geometry(q, k)
        lse, delta = (torch.zeros(2, 4, 256) for _ in range(2))
        _flash_bwd_sm90.backward_sm90(
            q, k, v, dout, lse, delta, _flash_bwd_sm90.dq_accumulator(q), torch.empty_like(k),
            torch.empty_like(v), geom,
            softmax_scale=0.125, causal=causal, bottom_right=True, signature=signature,
        )  # fmt: skip
    return launches


def test_sm90_backward_launch_plan_is_made_once_per_signature(monkeypatch):
    """With a signature the launch's grid, integers and constexprs come from a plan made once
    per signature, mask and module setting (the launch gets its slot); they equal what a call
    without a signature computes afresh."""
    monkeypatch.setattr(_flash_bwd_sm90, "_PLANS", {})
    sig = ("sig", 1)
    launches = _recorded_bwd_launches(
        monkeypatch, [(128, True, sig), (128, True, sig), (128, True, None), (128, False, sig)]
    )
    (g1, a1, k1), (g2, a2, k2), (g3, a3, k3), (_, _, k4) = launches
    assert len(_flash_bwd_sm90._PLANS) == 2
    assert k1["slot"] is k2["slot"] is not None and k3["slot"] is None
    assert k4["slot"] is not k1["slot"] and not k4["IS_CAUSAL"]
    assert g1 == g2 == g3 and k1 == k2
    drop = ("slot", "signature")
    assert {n: x for n, x in k1.items() if n not in drop} == {
        n: x for n, x in k3.items() if n not in drop
    }
    scalars = [[x for x in args if isinstance(x, (int, float))] for args in (a1, a2, a3)]
    assert scalars[0] == scalars[1] == scalars[2]
    assert a1[4].base is not a2[4].base  # each call's own zeroed dQ accumulator
    monkeypatch.setitem(_flash_bwd_sm90.DQ_BEFORE_DK, 128, False)  # a module setting
    ((_, _, k5),) = _recorded_bwd_launches(monkeypatch, [(128, True, sig)])
    assert k5["slot"] is not k1["slot"] and not k5["DQ_FIRST"]


@pytest.mark.parametrize("layout", ["dense", "seqlens_q", "seqlens_k", "varlen", "varlen_offsets"])
def test_plans_keep_only_geometries_without_tensors(layout):
    """The launch plans keep a call's geometry for every later call of its signature only when
    the geometry holds no tensor: a later call's seqlens or cu_seqlens are its own tensors."""
    q = torch.randn(2, 16, 2, 64, dtype=torch.float16)
    lens = torch.tensor([16, 9], dtype=torch.int32)
    cu = torch.tensor([0, 16, 25], dtype=torch.int32)
    args = {
        "dense": dict(),
        "seqlens_q": dict(seqlens_q=lens),
        "seqlens_k": dict(seqlens_k=lens),
        "varlen": dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16),
        "varlen_offsets": dict(cu_seqlens_q=cu, cu_seqlens_k=cu, seq_offsets_q=cu,
                               seq_offsets_k=cu, max_seqlen_q=16, max_seqlen_k=16),
    }[layout]  # fmt: skip
    x = q.flatten(0, 1) if "cu_seqlens_q" in args else q
    geom = launch_geometry(x, x, **args)
    holds_tensor = any(
        isinstance(t, torch.Tensor)
        for seq in (geom.q, geom.k)
        for t in (seq.cu_seqlens, seq.seq_offsets, seq.seqlens)
    )
    kept = shape_only_geometry(geom)
    assert (kept is None) == holds_tensor
    if kept is not None:
        assert kept == launch_geometry(torch.randn_like(x), torch.randn_like(x))
