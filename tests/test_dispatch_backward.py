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
from fusedlayers.kernels._flash_bwd import flash_attention_backward


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
        # d = 80 and 96 run on d = 128's tiles; other dims below 128 do not.
        for d, covered in ((80, True), (96, True), (112, False), (72, False)):
            qd, kvd = (torch.randn(2, 300, n, d, dtype=torch.bfloat16) for n in (4, 2))
            assert (_plan(qd, kvd, kvd, qd) is not None) == covered, d
        assert _plan(q, kv, kv[..., :96], q) is None  # d_v != d_qk
        # auto follows the table (None entries mean never) and wants enough programs.
        set_backward_path("auto")
        monkeypatch.setitem(dispatch.SM90_BWD_MIN_KEYS, 128, None)
        assert _plan(q, kv, kv, q) is None
        monkeypatch.setitem(dispatch.SM90_BWD_MIN_KEYS, 128, 256)
        monkeypatch.setitem(dispatch.SM90_BWD_MIN_WAVES, 128, (0, 0))
        monkeypatch.setattr(dispatch, "SM90_BWD_SHORT_LOOP_WAVES", 0)
        assert _plan(q, kv, kv, q) is not None
        assert _plan(q[:, :200], kv[:, :200], kv[:, :200], q[:, :200]) is None  # 200 < 256 keys
        # 3 key blocks x 2 sequences x 2 KV heads = 12 programs: under one wave of the H100.
        monkeypatch.setitem(dispatch.SM90_BWD_MIN_WAVES, 128, (1, 1))
        assert _plan(q, kv, kv, q) is None
    finally:
        set_backward_path(previous)


@pytest.mark.parametrize(
    "d, b, h, h_kv, s, causal, taken",
    [
        (128, 1, 32, 4, 4096, False, True),  # 128 programs: one wave of 132 SMs, near enough
        (128, 1, 32, 4, 4096, True, False),  # causal: under 3 waves
        (128, 1, 16, 2, 4096, False, False),  # 64 programs: half a wave
        (128, 4, 32, 4, 4096, True, True),  # 512 programs: 3.9 waves
        (256, 1, 8, 2, 2048, False, True),  # 64 programs: any count above d = 128
        (256, 1, 8, 2, 2048, True, False),
        (128, 1, 16, 16, 2048, False, False),  # 256 programs, but loops of 2k query rows
        (128, 2, 16, 16, 2048, True, False),  # 512 programs: 3.9 waves, under the short loops' 4
        (128, 8, 16, 16, 2048, True, True),  # 2,048 programs
    ],
)
def test_auto_wants_more_waves_of_causal_programs(d, b, h, h_kv, s, causal, taken, monkeypatch):
    """Under "auto" the sm_90 backward's wave minimum depends on the mask and the tile width
    (`SM90_BWD_MIN_WAVES`): causal launches want 3 waves of programs, others about one up to
    d = 128 and none above; programs = key blocks (128 keys, 64 above d = 128) x b x h_kv. Up to
    d = 128, programs whose loop visits under 16k query rows (s_q x h / h_kv) want 4 waves."""
    monkeypatch.setattr(dispatch, "_on_sm90", lambda t: True)
    monkeypatch.setattr(dispatch, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(_flash_bwd_sm90, "GLUON_AVAILABLE", True)
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16)
    kv = torch.empty(b, s, h_kv, d, dtype=torch.bfloat16)
    previous = set_backward_path("auto")
    try:
        plan = _plan(q, kv, kv, q, window_right=0 if causal else -1)
        assert (plan is not None) == taken
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


@pytest.mark.parametrize(
    "shape",
    [(2, 5, 3, 96), (1, 300, 2, 80), (7, 4, 96), (130, 1, 80)],
    ids=["dense-short", "dense-long", "varlen-short", "varlen-long"],
)
def test_dq_accumulator_pads_each_head_to_the_tile_width(shape):
    """d = 80 and 96 add 128-wide dQ shares (garbage past d): each head gets 128 columns of
    its own, so a share's garbage never lands in the next head's, and the TMA grid still has
    a whole box of rows behind it."""
    q = torch.randn(shape, dtype=torch.float16)
    width = _flash_bwd_sm90.tile_width(q.shape[-1])
    assert width == 128
    acc = _flash_bwd_sm90.dq_accumulator(q, width=width)
    assert acc.shape == (*q.shape[:-1], 128) and acc.is_contiguous()
    assert acc.stride(-2) == 128 and bool((acc == 0).all())
    rows = q.numel() // (q.shape[-1] * q.shape[-2])
    storage_rows = acc.untyped_storage().nbytes() // (4 * 128 * q.shape[-2])
    assert storage_rows >= max(rows, _flash_bwd_sm90.DQ_BOX[0])
    box = _flash_bwd_sm90.DQ_BOX[0]
    view = _flash_fwd_sm90.tma_view(acc, len(shape) == 3, box, storage_rows=box)
    assert view is not None and view[0][1] == 128 * q.shape[-2]


def test_rows_narrower_than_the_backward_tile_take_the_portable_kernels():
    """One head of d = 96 in rows 96 wide: a 128-wide TMA box would be wider than the grid."""
    one = torch.randn(1, 256, 1, 96, dtype=torch.float16)
    two = torch.randn(1, 256, 2, 96, dtype=torch.float16)
    assert _flash_bwd_sm90.plan_views(one, one, one, one, False) is None
    assert _flash_bwd_sm90.plan_views(two, two, two, two, False) is not None


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
    """Run `backward_sm90` on CPU tensors for each (d, causal, signature[, d_v]) of `calls`, its
    launch recorded instead of made: [(grid, positional args, keywords)]."""
    if not _flash_bwd_sm90.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    launches = []
    record = lambda kernel, grid, *args, **kw: launches.append((grid, args, kw))  # noqa: E731
    monkeypatch.setattr(_flash_bwd_sm90, "launch", record)
    for d, causal, signature, *d_v in calls:
        d_v = d_v[0] if d_v else d
        q, k = (torch.randn(2, 256, n, d, dtype=torch.float16) for n in (4, 2))
        v, dout = (torch.randn(2, 256, n, d_v, dtype=torch.float16) for n in (2, 4))
        geom = launch_geometry(q, k)
        lse, delta = (torch.zeros(2, 4, 256) for _ in range(2))
        acc = _flash_bwd_sm90.dq_accumulator(q, width=_flash_bwd_sm90.tile_width(d))
        _flash_bwd_sm90.backward_sm90(
            q, k, v, dout, lse, delta, acc, torch.empty_like(k), torch.empty_like(v), geom,
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


def test_wide_defaults_name_fitting_variants_for_each_wide_dims_pair():
    """`WIDE_DEFAULTS` decides the wide schedule's variants for every dims pair on 256-wide
    tiles, and only there; each it names exists and fits shared memory at those dims."""
    wide = {dims for dims in _flash_bwd_sm90.SUPPORTED_DIMS
            if _flash_bwd_sm90.tile_width(dims[0]) > 128}  # fmt: skip
    assert set(_flash_bwd_sm90.WIDE_DEFAULTS) == wide
    for (d, d_v), names in _flash_bwd_sm90.WIDE_DEFAULTS.items():
        assert all(_flash_bwd_sm90.wide_variant_fits(n, d, d_v) for n in names), (d, d_v)
    assert _flash_bwd_sm90.wide_settings(128, 128) == {}
    assert not _flash_bwd_sm90.wide_variant_fits("dv_early", 128, 128)
    assert not _flash_bwd_sm90.wide_variant_fits("split_ring", 192, 192)
    assert _flash_bwd_sm90.wide_variant_fits("split_ring", 192, 128)


# (d_qk, d_v) -> (NUM_STAGES, DO_STAGES, DV_EARLY) of the default launch: the split ring at
# (192, 128), dV before dS^T at 160 and 192, neither at 256 nor below 256-wide tiles.
WIDE_LAUNCHES = {
    (128, 128): (2, 2, False), (160, 160): (1, 1, True), (192, 192): (1, 1, True),
    (256, 256): (1, 1, False), (192, 128): (2, 1, False),
}  # fmt: skip


@pytest.mark.parametrize("dims", list(WIDE_LAUNCHES), ids=lambda t: f"{t[0]}x{t[1]}")
def test_sm90_backward_launches_the_dims_wide_variants(dims, monkeypatch):
    """Each dims pair launches the variants `WIDE_DEFAULTS` gives it; flipping one there (the
    A/B tool's and the GPU tests' way) makes a new plan whose launch has it flipped, and a
    variant that does not fit, or any below 256-wide tiles, is refused."""
    monkeypatch.setattr(_flash_bwd_sm90, "_PLANS", {})
    d, d_v = dims
    sig = ("sig", dims)
    ((_, _, kw),) = _recorded_bwd_launches(monkeypatch, [(d, True, sig, d_v)])
    assert (kw["NUM_STAGES"], kw["DO_STAGES"], kw["DV_EARLY"]) == WIDE_LAUNCHES[dims]
    if d <= 128:
        monkeypatch.setitem(_flash_bwd_sm90.WIDE_DEFAULTS, dims, ("dv_early",))
        with pytest.raises(ValueError, match="dv_early does not fit"):
            _recorded_bwd_launches(monkeypatch, [(d, True, sig, d_v)])
        return
    on = _flash_bwd_sm90.WIDE_DEFAULTS[dims]
    monkeypatch.setitem(_flash_bwd_sm90.WIDE_DEFAULTS, dims, ())  # every variant off
    ((_, _, off),) = _recorded_bwd_launches(monkeypatch, [(d, True, sig, d_v)])
    assert (off["NUM_STAGES"], off["DO_STAGES"], off["DV_EARLY"]) == (1, 1, False)
    assert (off["slot"] is not kw["slot"]) == bool(on)  # a new plan unless nothing changed
    assert len(_flash_bwd_sm90._PLANS) == (2 if on else 1)
    monkeypatch.setitem(_flash_bwd_sm90.WIDE_DEFAULTS, dims, (*on, "dv_early", "split_ring"))
    if d_v > 128:
        with pytest.raises(ValueError, match="split_ring does not fit"):
            _recorded_bwd_launches(monkeypatch, [(d, True, sig, d_v)])
    else:
        ((_, _, both),) = _recorded_bwd_launches(monkeypatch, [(d, True, sig, d_v)])
        assert (both["NUM_STAGES"], both["DO_STAGES"], both["DV_EARLY"]) == (2, 1, True)


@pytest.mark.parametrize("d", [80, 96])
def test_sm90_backward_at_80_and_96_launches_128_wide_tiles(d, monkeypatch):
    """d = 80 and 96 launch d = 128's configuration: 128-wide TMA boxes for q, k, v, dout and
    two 64-wide dQ boxes over an accumulator of 128 columns a head, with HEAD_DIM = d (the
    columns the scores sum over and dK/dV store); an accumulator of d columns is refused."""
    monkeypatch.setattr(_flash_bwd_sm90, "_PLANS", {})
    ((grid, args, kw),) = _recorded_bwd_launches(monkeypatch, [(d, True, None)])
    ((_, _, kw128),) = _recorded_bwd_launches(monkeypatch, [(128, True, None)])
    assert kw["HEAD_DIM"] == kw["HEAD_DIM_V"] == d and kw128["HEAD_DIM"] == 128
    drop = ("HEAD_DIM", "HEAD_DIM_V", "slot", "signature")
    assert {n: x for n, x in kw.items() if n not in drop} == {
        n: x for n, x in kw128.items() if n not in drop
    }
    q_desc, k_desc, v_desc, do_desc, dq_desc = args[:5]
    assert [list(t.block_shape) for t in (q_desc, k_desc, v_desc, do_desc)] == [
        [64, 128], [128, 128], [128, 128], [64, 128]
    ]  # fmt: skip
    assert list(dq_desc.block_shape) == [64, 64] and dq_desc.base.shape[-1] == 128
    assert dq_desc.shape[1] == dq_desc.base.shape[-2] * 128  # grid rows: 128 columns a head
    q, k = (torch.randn(2, 256, n, d, dtype=torch.float16) for n in (4, 2))
    lse = torch.zeros(2, 4, 256)
    with pytest.raises(ValueError, match="accumulator's rows are .* wide, not the tiles' 128"):
        _flash_bwd_sm90.backward_sm90(
            q, k, k, q, lse, lse, _flash_bwd_sm90.dq_accumulator(q), torch.empty_like(k),
            torch.empty_like(k), launch_geometry(q, k), softmax_scale=0.1, causal=False,
            bottom_right=True,
        )  # fmt: skip


@pytest.mark.parametrize("layout", ["dense", "varlen"])
@pytest.mark.parametrize("d", [80, 96, 192])
def test_backward_hands_the_sm90_kernel_a_padded_dq_accumulator(d, layout, monkeypatch):
    """The launcher's side of d = 80, 96 and 192 on the sm_90 backward, with a stand-in for the
    kernel: it gets an accumulator of `tile_width(d)` (128, 256) columns a head whose first d
    are zero (the preprocess
    zeroes them where every row belongs to a sequence; the rest arrive NaN-filled here), adds
    a known dQ into those and NaN into the padding; dq must be the known dQ times the softmax
    scale, no NaN leaking in, and dk / dv what the kernel wrote."""
    monkeypatch.setattr(dispatch, "_on_sm90", lambda t: True)
    real_accumulator = _flash_bwd_sm90.dq_accumulator

    def nan_unless_zeroed(q, zeroed=True, width=None):
        acc = real_accumulator(q, zeroed=zeroed, width=width)
        return acc if zeroed else acc.fill_(float("nan"))

    g = torch.Generator().manual_seed(d)
    q, dout = (torch.randn(2, 130, 4, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(2, 140, 2, d, generator=g).half() for _ in range(2))
    out = torch.randn(2, 130, 4, d, generator=g).half()
    lse = torch.randn(2, 4, 130, generator=g)
    seq = {}
    if layout == "varlen":
        q, dout, out, k, v = (t.flatten(0, 1) for t in (q, dout, out, k, v))
        lse = torch.randn(4, 260, generator=g)
        seq = dict(cu_seqlens_q=torch.tensor([0, 130, 260], dtype=torch.int32),
                   cu_seqlens_k=torch.tensor([0, 140, 280], dtype=torch.int32),
                   max_seqlen_q=130, max_seqlen_k=140)  # fmt: skip
    known = torch.randn(*q.shape, generator=g)
    dk_known, dv_known = torch.randn_like(k), torch.randn_like(v)
    calls = []

    def kernel(q_, k_, v_, dout_, lse_, delta, dq_acc, dk, dv, geom, **kw):
        width = _flash_bwd_sm90.tile_width(d)
        assert dq_acc.shape == (*q.shape[:-1], width) and dq_acc.is_contiguous()
        assert bool((dq_acc[..., :d] == 0).all())
        dq_acc[..., :d] += known
        dq_acc[..., d:] = float("nan")
        dk.copy_(dk_known)
        dv.copy_(dv_known)
        calls.append(kw)

    monkeypatch.setattr(_flash_bwd_sm90, "dq_accumulator", nan_unless_zeroed)
    monkeypatch.setattr(_flash_bwd_sm90, "backward_sm90", kernel)
    previous = set_backward_path("sm90")
    try:
        dq, dk, dv, _ = flash_attention_backward(
            dout, q, k, v, out, lse, softmax_scale=0.125, window_right=0, **seq
        )
    finally:
        set_backward_path(previous)
    assert len(calls) == 1 and calls[0]["causal"]
    assert dq.shape == q.shape and dq.dtype == q.dtype and dq.is_contiguous()
    assert torch.equal(dq, (known * 0.125).half())
    assert torch.equal(dk, dk_known) and torch.equal(dv, dv_known)


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


WIDE_PAIRS = [(160, 160), (192, 192), (256, 256), (192, 128)]
WIDE_IDS = ["160", "192", "256", "192x128"]


@pytest.mark.parametrize("d_qk, d_v", WIDE_PAIRS, ids=WIDE_IDS)
def test_wide_head_dims_follow_the_length_table(d_qk, d_v, monkeypatch):
    """d = 160, 192, 256 and (192, 128) take the sm_90 backward's 256-wide schedule when
    pinned, and under "auto" from `SM90_BWD_MIN_KEYS` keys on (by d_qk); one KV head of 160
    or 192 columns in rows d wide is narrower than the 256-wide box and is not taken."""
    monkeypatch.setattr(dispatch, "_on_sm90", lambda t: True)
    monkeypatch.setattr(_flash_bwd_sm90, "GLUON_AVAILABLE", True)
    monkeypatch.setitem(dispatch.SM90_BWD_MIN_WAVES, 256, (0, 0))
    q, dout = (torch.randn(2, 4096, 4, d_qk, dtype=torch.bfloat16) for _ in range(2))
    k = torch.randn(2, 4096, 2, d_qk, dtype=torch.bfloat16)
    v = torch.randn(2, 4096, 2, d_v, dtype=torch.bfloat16)
    dout = dout[..., :d_v]
    previous = set_backward_path("sm90")
    try:
        views, causal = _plan(q, k, v, dout, window_right=0)
        assert causal and len(views) == 4
        assert _plan(q, k, v, dout) is not None
        if d_qk < 256:
            one_k, one_v = (t[:, :, :1].contiguous() for t in (k, v))  # rows d wide
            assert _plan(q, one_k, one_v, dout) is None
        set_backward_path("auto")
        assert _plan(q, k, v, dout) is not None
        assert _plan(q, k, v, dout, window_right=0) is not None
        monkeypatch.setitem(dispatch.SM90_BWD_MIN_KEYS, d_qk, 8192)
        assert _plan(q, k, v, dout) is None  # 4096 keys, under the table's
    finally:
        set_backward_path(previous)


@pytest.mark.parametrize("d_qk, d_v", WIDE_PAIRS, ids=WIDE_IDS)
def test_sm90_backward_wide_dims_launch_64_keys_and_256_wide_tiles(d_qk, d_v, monkeypatch):
    """d = 160, 192 and 256 launch the column-split configuration (`_flash_bwd_sm90_wide`): 64 keys
    a program, steps of 64 query rows (one stage; two Q stages at (192, 128), the split ring:
    `WIDE_LAUNCHES`), 256-wide q and k boxes (v and dout as wide as their
    tile width), 128-wide dQ boxes over an accumulator of 256 columns a head; HEAD_DIM and
    HEAD_DIM_V are the dims themselves."""
    if not _flash_bwd_sm90.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(_flash_bwd_sm90, "_PLANS", {})
    launches = []
    record = lambda kernel, grid, *args, **kw: launches.append((grid, args, kw))  # noqa: E731
    monkeypatch.setattr(_flash_bwd_sm90, "launch", record)
    q = torch.randn(2, 256, 4, d_qk, dtype=torch.float16)
    k = torch.randn(2, 256, 2, d_qk, dtype=torch.float16)
    v = torch.randn(2, 256, 2, d_v, dtype=torch.float16)
    dout = torch.randn(2, 256, 4, d_v, dtype=torch.float16)
    lse = torch.zeros(2, 4, 256)
    acc = _flash_bwd_sm90.dq_accumulator(q, width=_flash_bwd_sm90.tile_width(d_qk))
    _flash_bwd_sm90.backward_sm90(
        q, k, v, dout, lse, lse, acc, torch.empty_like(k), torch.empty_like(v),
        launch_geometry(q, k), softmax_scale=0.1, causal=True, bottom_right=True,
    )  # fmt: skip
    ((grid, args, kw),) = launches
    assert grid == (256 // 64 * 2 * 2,)  # 64 keys a program, 2 sequences x 2 KV heads
    assert (kw["BLOCK_N"], kw["BLOCK_M"]) == (64, 64)
    assert (kw["NUM_STAGES"], kw["DO_STAGES"]) == WIDE_LAUNCHES[(d_qk, d_v)][:2]
    assert (kw["HEAD_DIM"], kw["HEAD_DIM_V"]) == (d_qk, d_v)
    width_v = _flash_bwd_sm90.tile_width(d_v)
    q_desc, k_desc, v_desc, do_desc, dq_desc = args[:5]
    assert [list(t.block_shape) for t in (q_desc, k_desc, v_desc, do_desc)] == [
        [64, 256], [64, 256], [64, width_v], [64, width_v]
    ]  # fmt: skip
    assert list(dq_desc.block_shape) == [64, 128] and dq_desc.base.shape[-1] == 256
    assert _flash_bwd_sm90.block_n(d_qk) == 64 and _flash_bwd_sm90.dq_box(d_qk) == (64, 128)
