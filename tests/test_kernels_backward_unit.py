"""The flash-attention backward launcher, run under the Triton interpreter, against fp64 autograd.

`flash_attention_backward` is called directly with `out`/`lse` from the reference run in the
input dtype (what a forward in that dtype returns), so these checks isolate the backward. Pass
rule: each gradient's max error against fp64 autograd through `attention_reference` is at most
3x the error of the same gradient computed by PyTorch from input-dtype tensors, plus four units of
the dtype at the gradient's magnitude (the kernels exponentiate in the log2 domain, with log2(e)
folded into the scale and bias, which costs fp32 a few ulps over PyTorch's natural exp; any
indexing or masking fault is orders of magnitude larger). fp16/fp32 only: the interpreter's bf16
dot is broken (Triton issue 11584); bf16 runs in tests/gpu/test_backward_gpu.py.

Layouts: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d(_v)]; varlen q [t_q, h, d] with
cu_seqlens / seq_offsets; lse dense [b, h, s_q] / varlen [h, t_q].
"""

from __future__ import annotations

import pytest
import torch
from attention_testing import KernelSpy
from fusedlayers.kernels import _common, _flash_bwd, dropout_keep_mask
from fusedlayers.kernels._flash_bwd import flash_attention_backward

from fusedlayers.attention.reference import attention_reference

F16, F32 = torch.float16, torch.float32


@pytest.fixture(autouse=True, params=["delta_in_dq", "preprocess"])
def delta_pass(request, monkeypatch):
    """Every check in both orders of the two-pass scheme: delta computed by the dQ pass, which
    runs first (calls up to `DELTA_IN_DQ_MAX_LEN`, all of these), and the preprocess first."""
    if request.param == "preprocess":
        monkeypatch.setattr(_flash_bwd, "DELTA_IN_DQ_MAX_LEN", 0)
    return request.param


def _randn(g: torch.Generator, *shape: int, dtype=F32) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def _reference(tensors: dict, dtype: torch.dtype, ref_kwargs: dict):
    """(out, lse, {dq, dk, dv[, dbias]}) from attention_reference on copies in `dtype`."""
    leaves = {n: tensors[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v")}
    bias = None
    if tensors.get("bias_leaf") is not None:
        leaves["bias"] = tensors["bias_leaf"].detach().to(dtype).requires_grad_()
        bias = leaves["bias"].expand(tensors["bias_shape"])
    out, lse = attention_reference(
        leaves["q"], leaves["k"], leaves["v"], bias=bias, return_lse=True, **ref_kwargs
    )
    grads = torch.autograd.grad(out, list(leaves.values()), tensors["dout"].to(dtype))
    return out.detach(), lse, {f"d{n}": gr for n, gr in zip(leaves, grads)}


def _assert_rule(name: str, actual: torch.Tensor, high: torch.Tensor, low: torch.Tensor):
    assert actual.shape == high.shape, f"{name}: shape {tuple(actual.shape)} != {high.shape}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite gradient"
    error = (actual.double() - high).abs().max().item()
    pytorch_error = (low.double() - high).abs().max().item()
    atol = 4 * torch.finfo(actual.dtype).eps * max(high.abs().max().item(), 1e-3)
    bound = 3.0 * pytorch_error + atol
    assert error <= bound, (
        f"{name}: kernel max error {error:.3e} > 3 x PyTorch {low.dtype} error "
        f"{pytorch_error:.3e} + atol {atol:.1e}"
    )


def _check(tensors: dict, dtype, ref_kwargs: dict, kernel_kwargs: dict) -> dict:
    """Run the backward on the low-precision forward results and apply the pass rule."""
    _, _, high = _reference(tensors, torch.float64, ref_kwargs)
    out, lse, low = _reference(tensors, dtype, ref_kwargs)
    cast = {n: tensors[n].to(dtype) for n in ("q", "k", "v", "dout")}
    bias = tensors.get("bias_leaf")
    dq, dk, dv, dbias = flash_attention_backward(
        cast["dout"], cast["q"], cast["k"], cast["v"], out, lse,
        bias=None if bias is None else bias.to(dtype).expand(tensors["bias_shape"]),
        bias_requires_grad=bias is not None, **kernel_kwargs,
    )  # fmt: skip
    got = dict(dq=dq, dk=dk, dv=dv)
    if bias is not None:
        # The launcher returns the full [b, h, s_q, s_k] gradient; expand()'s backward sums it.
        got["dbias"] = dbias.sum_to_size(bias.shape)
    else:
        assert dbias is None
    for name, value in got.items():
        _assert_rule(name, value, high[name], low[name])
    return got


def _dense(seed, b, s_q, s_k, h, h_kv, d, d_v=None, dtype=F32) -> dict:
    g = torch.Generator().manual_seed(seed)
    d_v = d_v or d
    return dict(
        q=_randn(g, b, s_q, h, d, dtype=dtype),
        k=_randn(g, b, s_k, h_kv, d, dtype=dtype),
        v=_randn(g, b, s_k, h_kv, d_v, dtype=dtype),
        dout=_randn(g, b, s_q, h, d_v, dtype=dtype),
    )


def _mask_kwargs(scale, window, bottom_right, **extra) -> tuple[dict, dict]:
    """Matching (reference kwargs, kernel kwargs) for the mask and score options."""
    ref = dict(softmax_scale=scale, window_size=window, bottom_right=bottom_right, **extra)
    kern = dict(
        softmax_scale=scale, window_left=window[0], window_right=window[1],
        bottom_right=bottom_right, **extra,
    )  # fmt: skip
    return ref, kern


# (b, s_q, s_k, h, h_kv, d, d_v, dtype, window, bottom_right): shapes span several 16-wide blocks
# with ragged edges; windows make the launcher skip blocks and run unmasked interior blocks.
DENSE_CASES = {
    "mha-full-d40-fp32": (1, 40, 33, 2, 2, 40, None, F32, (-1, -1), True),
    "gqa-causal-br-d59-dv24": (1, 24, 40, 4, 2, 59, 24, F16, (-1, 0), True),
    "mqa-causal-tl-d8": (2, 40, 24, 2, 1, 8, None, F16, (-1, 0), False),
    "window-br-d80": (1, 33, 47, 2, 1, 80, None, F16, (5, 3), True),
    "narrow-band-tl": (1, 48, 48, 2, 2, 16, None, F32, (1, 0), False),
    "long-window-tl-dv64": (1, 64, 64, 1, 1, 32, 64, F16, (20, -1), False),
}


@pytest.mark.parametrize("case", DENSE_CASES.values(), ids=DENSE_CASES.keys())
def test_dense_gradients(case):
    b, s_q, s_k, h, h_kv, d, d_v, dtype, window, bottom_right = case
    tensors = _dense(s_q * 7 + d, b, s_q, s_k, h, h_kv, d, d_v, dtype)
    ref, kern = _mask_kwargs(d**-0.5, window, bottom_right)
    _check(tensors, dtype, ref, kern)


@pytest.mark.parametrize("order_pairs", [1, 4, 9])
def test_causal_launch_order_covers_every_block(monkeypatch, order_pairs):
    """Causal launches of both passes interleave (sequence, head) pairs longest-first
    (`_common.causal_order_heads`): one pair at a time, 4 of 9 (a smaller last group) and all 9.
    dq, dk and dv are allocated uninitialized, so a block the order skipped fails the rule."""
    tensors = _dense(order_pairs, 3, 40, 40, 3, 3, 16, dtype=F16)
    # q/dO rows stream in the dK/dV pass, k/v rows in the dQ pass: 64 bytes a row either way.
    monkeypatch.setattr(_common, "CAUSAL_ORDER_L2_BYTES", order_pairs * 40 * 64)
    assert _common.causal_order_heads(40, 64, 1, 9) == order_pairs
    ref, kern = _mask_kwargs(0.25, (-1, 0), False)
    _check(tensors, F16, ref, kern)


def test_softcap_alibi_and_scale():
    tensors = _dense(1, 2, 24, 40, 2, 1, 32, dtype=F32)
    slopes = torch.rand(2, 2, generator=torch.Generator().manual_seed(2)) * 0.5
    ref, kern = _mask_kwargs(0.4, (-1, 0), True, softcap=2.5, alibi_slopes=slopes)
    _check(tensors, F32, ref, kern)


@pytest.mark.parametrize(
    "bias_shape,dtype",
    [((2, 2, 24, 33), F16), ((1, 2, 24, 33), F32), ((2, 1, 1, 33), F32)],
    ids=["full-fp16", "shared-batch", "key-only"],
)
def test_bias_gradient(bias_shape, dtype):
    """dBias, also for bias views broadcast (stride 0) over batch, heads or queries."""
    tensors = _dense(3, 2, 24, 33, 2, 2, 16, dtype=dtype)
    tensors["bias_leaf"] = _randn(torch.Generator().manual_seed(4), *bias_shape, dtype=dtype)
    tensors["bias_shape"] = (2, 2, 24, 33)
    ref, kern = _mask_kwargs(0.25, (9, 4), False)
    _check(tensors, dtype, ref, kern)


def test_dropout_regenerates_the_forward_mask():
    """The reference gets the kernels' own keep-mask, so any mismatch in the dropped set fails."""
    tensors = _dense(5, 1, 40, 36, 4, 2, 16, dtype=F16)
    seed, offset, p = 987654, 321, 0.3
    keep = dropout_keep_mask((seed, offset), 1, 4, 40, 36, p, "cpu")
    ref, kern = _mask_kwargs(0.25, (12, 0), True, dropout_p=p)
    ref["dropout_mask"] = keep
    _check(tensors, F16, ref, dict(kern, seed=seed, offset=offset))


def _varlen_meta(lens_q, lens_k, gap):
    def offsets(lens):
        starts = [gap * (z + 1) + sum(lens[:z]) for z in range(len(lens) + 1)]
        return torch.tensor(starts, dtype=torch.int32)

    def cumulative(lens):
        return torch.tensor([sum(lens[:z]) for z in range(len(lens) + 1)], dtype=torch.int32)

    return cumulative(lens_q), cumulative(lens_k), offsets(lens_q), offsets(lens_k)


def _varlen_tensors(lens_q, lens_k, gap, h, h_kv, d, dtype, seed):
    """thd inputs with `gap` unused rows before each sequence and 2 after the last."""
    cu_q, cu_k, off_q, off_k = _varlen_meta(lens_q, lens_k, gap)
    g = torch.Generator().manual_seed(seed)
    t_q, t_k = int(off_q[-1]) + 2, int(off_k[-1]) + 2
    tensors = dict(
        q=_randn(g, t_q, h, d, dtype=dtype), k=_randn(g, t_k, h_kv, d, dtype=dtype),
        v=_randn(g, t_k, h_kv, d, dtype=dtype), dout=_randn(g, t_q, h, d, dtype=dtype),
    )  # fmt: skip
    ref = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k)
    ref.update(cu_seqlens_q_padded=off_q, cu_seqlens_kv_padded=off_k)
    kern = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seq_offsets_q=off_q, seq_offsets_k=off_k)
    kern.update(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return tensors, ref, kern


def test_varlen_with_gaps_and_an_empty_sequence():
    """thd with padded offsets: rows between sequences get zero gradients, empty sequence too."""
    lens_q, lens_k, gap = [17, 0, 30, 5], [20, 9, 30, 1], 3
    tensors, ref_seq, kern_seq = _varlen_tensors(lens_q, lens_k, gap, 2, 1, 24, F16, seed=6)
    _, _, off_q, off_k = _varlen_meta(lens_q, lens_k, gap)
    t_k = tensors["k"].shape[0]
    ref, kern = _mask_kwargs(0.2, (-1, 0), True)
    ref, kern = dict(ref, **ref_seq), dict(kern, **kern_seq)
    got = _check(tensors, F16, ref, kern)
    owned_k = torch.zeros(t_k, dtype=torch.bool)
    for start, n in zip(off_k.tolist(), lens_k):
        owned_k[start : start + n] = True
    assert (got["dk"][~owned_k] == 0).all() and (got["dv"][~owned_k] == 0).all()
    assert (got["dq"][: int(off_q[0])] == 0).all()


def test_varlen_bias_gradient():
    """Varlen bias [b, h, max_s_q, max_s_k]: positions within each sequence, as the forward's."""
    lens_q, lens_k = [9, 20, 4], [30, 11, 17]
    tensors, ref_seq, kern_seq = _varlen_tensors(lens_q, lens_k, 2, 2, 2, 16, F32, seed=11)
    tensors["bias_leaf"] = _randn(torch.Generator().manual_seed(12), 3, 1, 20, 30)
    tensors["bias_shape"] = (3, 2, 20, 30)
    ref, kern = _mask_kwargs(0.3, (-1, 2), False)
    _check(tensors, F32, dict(ref, **ref_seq), dict(kern, **kern_seq))


def test_dense_right_padding():
    """seqlens: rows past each sequence's length get zero gradients."""
    tensors = _dense(7, 2, 33, 40, 2, 2, 16, dtype=F32)
    seqlens_q = torch.tensor([33, 9], dtype=torch.int32)
    seqlens_k = torch.tensor([17, 40], dtype=torch.int32)
    ref, kern = _mask_kwargs(0.25, (-1, 0), False, seqlens_q=seqlens_q)
    ref["seqlens_kv"] = seqlens_k
    got = _check(tensors, F32, ref, dict(kern, seqlens_k=seqlens_k))
    assert (got["dq"][1, 9:] == 0).all()
    assert (got["dk"][0, 17:] == 0).all() and (got["dv"][0, 17:] == 0).all()


def test_rows_without_visible_keys_get_zero_gradients():
    """Bottom-right causal with s_q > s_k: the first s_q - s_k queries see nothing (LSE -inf)."""
    tensors = _dense(8, 1, 40, 16, 2, 1, 16, dtype=F16)
    ref, kern = _mask_kwargs(0.25, (-1, 0), True)
    got = _check(tensors, F16, ref, kern)
    assert (got["dq"][:, :24] == 0).all()


def test_strided_views_of_packed_buffers():
    """q/k/v sliced from one [b, s, h + 2, d] projection (GQA, TE issue 1195), strided dout/out."""
    g = torch.Generator().manual_seed(9)
    qkv = _randn(g, 2, 20, 4 + 2, 32, dtype=F16)
    q, k, v = qkv[:, :, :4], qkv[:, :, 4:5], qkv[:, :, 5:6]
    dout = _randn(g, 2, 4, 20, 32, dtype=F16).transpose(1, 2)
    tensors = dict(q=q, k=k, v=v, dout=dout)
    ref, kern = _mask_kwargs(0.2, (6, 0), True)
    _, _, high = _reference(tensors, torch.float64, ref)
    out, lse, low = _reference(tensors, F16, ref)
    out_strided = torch.empty(2, 4, 20, 32, dtype=F16).transpose(1, 2).copy_(out)
    grads = flash_attention_backward(dout, q, k, v, out_strided, lse, **kern)
    for name, value in zip(("dq", "dk", "dv"), grads):
        assert value.is_contiguous()
        _assert_rule(name, value, high[name], low[name])


def test_deterministic_flag_changes_nothing_off_cuda():
    """By default both flags run the two-pass scheme (ATOMIC_DQ_DEVICES = "never"), so they
    agree bitwise; the atomic scheme is tested in test_kernels_backward_atomic.py."""
    tensors = _dense(10, 1, 24, 40, 2, 1, 16, dtype=F16)
    _, kern = _mask_kwargs(0.25, (-1, -1), True)
    out, lse, _ = _reference(tensors, F16, _mask_kwargs(0.25, (-1, -1), True)[0])
    args = (tensors["dout"], tensors["q"], tensors["k"], tensors["v"], out, lse)
    first = flash_attention_backward(*args, **kern, deterministic=False)
    second = flash_attention_backward(*args, **kern, deterministic=True)
    for a, b in zip(first[:3], second[:3]):
        assert torch.equal(a, b)


def test_round_trip_with_the_forward_kernel():
    """out/lse from flash_attention_forward itself, with dropout: both kernels drop the same set."""
    from fusedlayers.kernels._flash_fwd import flash_attention_forward

    tensors = _dense(13, 1, 33, 40, 4, 2, 24, dtype=F16)
    seed, offset, p = 4242, 17, 0.2
    keep = dropout_keep_mask((seed, offset), 1, 4, 33, 40, p, "cpu")
    ref, kern = _mask_kwargs(0.3, (15, 0), True, dropout_p=p)
    _, _, high = _reference(tensors, torch.float64, dict(ref, dropout_mask=keep))
    _, _, low = _reference(tensors, F16, dict(ref, dropout_mask=keep))
    seq = dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q", "seq_offsets_k",
                         "max_seqlen_q", "max_seqlen_k", "seqlens_q", "seqlens_k"))  # fmt: skip
    q, k, v, dout = (tensors[n] for n in ("q", "k", "v", "dout"))
    out, lse = flash_attention_forward(
        q, k, v, **seq, **kern, bias=None, alibi_slopes=None, softcap=0.0, seed=seed, offset=offset
    )
    grads = flash_attention_backward(dout, q, k, v, out, lse, **kern, seed=seed, offset=offset)
    for name, value in zip(("dq", "dk", "dv"), grads):
        _assert_rule(name, value, high[name], low[name])


@pytest.mark.parametrize(
    "h, h_kv, splits, window",
    [(4, 1, 4, (-1, 0)), (6, 2, 2, (-1, -1)), (5, 1, 2, (7, 0))],
    ids=["mqa-4-shares-causal", "gqa-2-shares", "uneven-shares-window"],
)
def test_gqa_group_split_over_programs(monkeypatch, h, h_kv, splits, window):
    """dK/dV with the GQA group dealt out over several programs (fp32 partial sums added after):
    the same gradients as the one-program-per-group launch, within the pass rule."""
    monkeypatch.setattr(_flash_bwd, "GROUP_SPLITS_OVERRIDE", splits)
    spy = KernelSpy(_flash_bwd._flash_bwd_dkdv_kernel)
    monkeypatch.setattr(_flash_bwd, "_flash_bwd_dkdv_kernel", spy)
    tensors = _dense(13 + h, 2, 33, 40, h, h_kv, 16, dtype=F16)
    ref, kern = _mask_kwargs(0.25, window, True)
    _check(tensors, F16, ref, kern)
    group = h // h_kv
    expected = _flash_bwd.cdiv(group, _flash_bwd.cdiv(group, splits))
    assert spy.grids == [(expected * _flash_bwd.cdiv(40, 16) * 2 * h_kv,)]


def test_group_split_keeps_unowned_rows_zero(monkeypatch):
    """Varlen with gaps and an empty sequence, group split in 3: rows no sequence owns are 0."""
    monkeypatch.setattr(_flash_bwd, "GROUP_SPLITS_OVERRIDE", 3)
    lens_q, lens_k, gap = [17, 0, 30], [20, 9, 30], 3
    tensors, ref_seq, kern_seq = _varlen_tensors(lens_q, lens_k, gap, 3, 1, 16, F16, seed=14)
    _, _, _, off_k = _varlen_meta(lens_q, lens_k, gap)
    ref, kern = _mask_kwargs(0.2, (-1, 0), True)
    got = _check(tensors, F16, dict(ref, **ref_seq), dict(kern, **kern_seq))
    owned_k = torch.zeros(tensors["k"].shape[0], dtype=torch.bool)
    for start, n in zip(off_k.tolist(), lens_k):
        owned_k[start : start + n] = True
    assert (got["dk"][~owned_k] == 0).all() and (got["dv"][~owned_k] == 0).all()


def test_group_splits_fill_the_gpu_only_when_needed(monkeypatch):
    """The split count: none for MHA or plenty of programs; enough waves for MQA; never more
    shares than heads, and no empty share."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_flash_bwd, "multiprocessors", lambda device: 132)

    def splits(programs, group, device=cuda, causal=True):
        return _flash_bwd.group_splits(programs, group, device, causal)

    assert splits(256, 1) == 1  # MHA
    assert splits(10_000, 32) == 1  # enough programs already
    assert splits(256, 32) == 3  # MQA causal: 256 -> 768 programs >= 4 waves of 132
    assert splits(256, 32, causal=False) == 1  # equal work per program: 2 waves suffice
    assert splits(64, 32, causal=False) == 3  # under one wave: split
    assert splits(8, 4) == 4  # capped by the group
    assert splits(100, 5) == 5  # 6 wanted, 5 heads
    assert splits(200, 4) == 2  # 3 wanted: shares of 2 -> 2 shares
    assert splits(8, 4, torch.device("cpu")) == 1


def test_launch_table_by_sequence_length_and_mask():
    """Causal-like launches on sequences up to SHORT_SEQLEN read the short table; longer ones and
    non-causal ones the main table; the interpreter always gets its own small tiles."""
    limit = _flash_bwd.SHORT_SEQLEN
    for d in (64, 128, 256):
        short = _flash_bwd.bwd_config(d, True, limit, causal=True)
        long = _flash_bwd.bwd_config(d, True, limit + 1, causal=True)
        full = _flash_bwd.bwd_config(d, True, limit, causal=False)
        assert tuple(short.values()) == _flash_bwd.BWD_SHORT_CONFIGS[d]
        assert tuple(long.values()) == tuple(full.values()) == _flash_bwd.BWD_CONFIGS[d]
        on_interpreter = _flash_bwd.bwd_config(d, False, 1, causal=True)
        assert tuple(on_interpreter.values()) == _flash_bwd.INTERPRETER_CONFIG
    assert _flash_bwd.bwd_table(limit, True) is _flash_bwd.BWD_SHORT_CONFIGS
    assert _flash_bwd.bwd_table(limit + 1, True) is _flash_bwd.BWD_CONFIGS
    assert _flash_bwd.bwd_table(limit, False) is _flash_bwd.BWD_CONFIGS
    # The short entries differ where the sweep found a faster tile, so the rule is not a no-op.
    assert _flash_bwd.BWD_SHORT_CONFIGS[64] != _flash_bwd.BWD_CONFIGS[64]


def test_backward_launch_reads_the_table_for_its_mask(monkeypatch, device):
    """flash_attention_backward passes the mask's right bound to the table choice."""
    seen = []
    original = _flash_bwd.bwd_config
    monkeypatch.setattr(
        _flash_bwd, "bwd_config", lambda *a, **kw: seen.append((a, kw)) or original(*a, **kw)
    )
    g = torch.Generator().manual_seed(3)
    q, k, v, out, dout = (torch.randn(1, 24, 2, 16, generator=g).to(device) for _ in range(5))
    lse = torch.randn(1, 2, 24, generator=g).to(device)  # any values: only the launch is checked
    for window_right in (0, -1):
        kw = dict(softmax_scale=0.25, window_left=-1, window_right=window_right)
        flash_attention_backward(dout, q, k, v, out, lse, **kw, deterministic=True)
    assert [s[1]["causal"] for s in seen] == [True, False]
    assert all(s[0][2] == 24 for s in seen)


@pytest.mark.parametrize(
    "limit, order", [(1024, ["dq", "dkdv"]), (23, ["preprocess", "dkdv", "dq"])]
)
def test_short_two_pass_calls_compute_delta_in_the_dq_pass(monkeypatch, limit, order):
    """Up to `DELTA_IN_DQ_MAX_LEN` (here 24 keys against a limit of 1024 or 23) the two-pass
    backward is two launches, the dQ pass first: it computes the delta the dK/dV pass reads.
    Longer calls run the preprocess first. The gradients are checked in both (the fixture)."""
    monkeypatch.setattr(_flash_bwd, "DELTA_IN_DQ_MAX_LEN", limit)
    launched = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("preprocess", "dkdv", "dq"):
        attr = f"_flash_bwd_{name}_kernel"
        monkeypatch.setattr(_flash_bwd, attr, Spy(name, getattr(_flash_bwd, attr)))
    tensors = _dense(5, 1, 24, 24, 2, 1, 16)
    ref, kern = _mask_kwargs(0.25, (-1, 0), True)
    _check(tensors, F32, ref, dict(kern, deterministic=True))
    assert launched == order
