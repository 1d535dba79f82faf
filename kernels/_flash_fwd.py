"""Flash-attention forward: one Triton kernel for dense, padded and varlen launches.

Shapes (docs/internals.md):
    dense  q [b, s_q, h_q, d_qk], k [b, s_k, h_kv, d_qk], v [b, s_k, h_kv, d_v]
           -> out [b, s_q, h_q, d_v], lse [b, h_q, s_q]
    varlen q [t_q, h_q, d_qk], k [t_k, h_kv, d_qk], v [t_k, h_kv, d_v]
           -> out [t_q, h_q, d_v], lse [h_q, t_q]
lse is fp32 in natural log. Every tensor arrives with its own strides (last dim contiguous), so
packed and transposed layouts are read in place.

Each program owns BLOCK_M query rows of head h of sequence z (1-D grid, see `_program_tile`).
Row i of sequence z lives at `z * stride_b + (start_z + i) * stride_s`; varlen launches have
stride_b = 0 and start_z from the offsets, dense ones start_z = 0 (see `_common.seq_bounds`).
Query head h reads KV head h // (h_q // h_kv). The key loop visits only blocks the window can
reach, and applies the mask only on the blocks that need it (`_common.key_block_range`).

Precision: softmax statistics and the accumulator are fp32. fp16/bf16 dots run on tensor cores with
fp32 accumulation; fp32 inputs use `input_precision="ieee"` (true fp32, about 1e-6 relative error)
rather than tf32 (about 5e-4), so fp32 results match PyTorch's fp32 attention closely.

FP8 (float8_e4m3fn, forward only, sm_89+): Q K^T is an fp8 dot with fp32 accumulation. The
descales are per (sequence, KV head), so each program reads its three once: q_descale * k_descale
joins the softmax scale (every score term is linear in it) and v_descale multiplies the output
rows at the end. P V runs in `PV_DTYPE` (bf16; fp32 under the interpreter, whose bf16 dot is
wrong): V is upcast in registers, exactly (e4m3's 4 significant bits fit bf16's 8), and P is
rounded to bf16 as in bf16 attention. Quantizing P to fp8 instead would double the tensor-core
rate of that product but put a 2^-4 relative error on every weight; bf16 keeps the fp8 path's
error at bf16 attention's. The output is bf16. The sm_90 kernels never take fp8 (`dispatch`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _common, _compat
from ._common import (
    LN2,
    LOG2E,
    MAX_PLANS,
    LaunchGeometry,
    attention_signature,
    causal_order_heads,
    cdiv,
    diagonal_offset,
    dropout_keep,
    empty,
    head_row_bytes,
    interleaved_tile,
    key_block_range,
    launch_geometry,
    load_bias_tile,
    load_tile,
    lse_strides,
    next_pow2,
    next_pow2_dim,
    remember,
    scores_log2,
    seed_offset,
    seq_bounds,
    seq_pointers,
    shape_only_geometry,
    smem_per_block,
    strides4,
    visible_tile,
    zeros,
)
from ._launch import config_slot, launch, launch_bound, launch_slot
from .dispatch import forward_path, run_sm90_forward, sm90_forward_plan

# --------------------------------------------------------------------------------------------------
# Autotune configs and their prune predicate
# --------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per padded head dim, for Hopper-class GPUs.
# From `examples/perf/tune_attention.py --fwd` on the H100 (bf16, s = 4096, 2026-11-23): d=128 (128,
# 128, 8, 3) 510 / 414 TF/s (non-causal / causal) against 464 / 391 for (128, 64, 8, 3); d=64 (128,
# 64, 4, 3) 436 / 366, (64, 64, 4, 3) 405 / 332, (128, 128, 4, 3) 407 / 322, (128, 128, 8, 3) 355 /
# 307. Warp-specialized loops (`tl.range(..., warp_specialize=True)`) were no faster (495 / 406
# at best) and some failed to compile in Triton 3.6.
_CANDIDATES = {
    16: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3)],
    32: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3)],
    64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    256: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2)],
}
# The interpreter runs one small config: multi-block loops on tiny shapes, no benchmarking.
_INTERPRET_CONFIG = (32, 16, 4, 1)


def _configs() -> list[triton.Config]:
    cands = (
        {_INTERPRET_CONFIG}
        if _compat.INTERPRETER
        else {c for cs in _CANDIDATES.values() for c in cs}
    )
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in sorted(cands)
    ]


def _prune_configs(configs, named_args, **kwargs):
    """Keep the candidates listed for this head dim that fit in shared memory."""
    if _compat.INTERPRETER:
        return configs
    args = {**named_args, **kwargs}
    block_d, block_dv = args["BLOCK_D"], args["BLOCK_DV"]
    wanted = set(_CANDIDATES[max(block_d, block_dv)])
    # fp8 inputs take the 16-bit tiles (V is staged again as bf16) until fp8 tiles are measured.
    elem = max(args["q_ptr"].element_size(), 2)
    kept = []
    for cfg in configs:
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
        if (bm, bn, cfg.num_warps, cfg.num_stages) not in wanted:
            continue
        # Q tile resident, K and V tiles multi-buffered by the pipeliner.
        smem = elem * (bm * block_d + cfg.num_stages * bn * (block_d + block_dv))
        # Against the device's own limit: an older fixed 200 KiB budget pruned d=128's fastest
        # tile, (128, 128, 8, 3) at 224 KiB of the H100's 227.
        if smem <= smem_per_block(args["q_ptr"].device):
            kept.append(cfg)
    # fp32 at d = 256 overflows every candidate: fall back to the smallest tile.
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def seq_bucket(max_len_q: int, max_len_k: int) -> int:
    """The autotuner's length bucket: the next power of two of the longer side, within [256,
    16384]. The best tile depends on the length (short sequences want more, smaller programs),
    but tuning per exact length would re-tune on every varlen batch."""
    return min(max(next_pow2(max(max_len_q, max_len_k, 1)), 256), 16384)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    bias_base, stride_bm, stride_bn,
    offs_m, offs_dk, offs_dv, lo, hi,
    diag, window_left, window_right, len_q, len_k,
    sm_scale, softcap, alibi_slope, seed, offset, bh, dropout_p,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, PV_DTYPE: tl.constexpr,
):  # fmt: skip
    """Online softmax over key blocks [lo, hi) for one query tile.

    acc [BLOCK_M, BLOCK_DV] fp32, l_i / m_i [BLOCK_M] fp32 (row sum, row max in log2 units),
    q [BLOCK_M, BLOCK_D]. MASKED blocks apply the window / key-length mask and bound the K/V loads;
    unmasked blocks are fully visible and inside len_k, so they skip both. P and V meet in
    PV_DTYPE (the input dtype, or bf16 for fp8 inputs).
    """
    offs_nb = tl.arange(0, BLOCK_N)
    qi = offs_m[:, None]  # query-major tiles: the helpers' index tiles (`_common` legend)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_nb
        kj = offs_n[None, :]
        # Block origin in int64: start_n * stride can pass 2^31 on long sequences.
        k_ptrs = k_base + tl.cast(start_n, tl.int64) * stride_kn
        k_ptrs = k_ptrs + offs_nb[:, None] * stride_kn + offs_dk[None, :] * stride_kd
        v_ptrs = v_base + tl.cast(start_n, tl.int64) * stride_vn
        v_ptrs = v_ptrs + offs_nb[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        key_ok = offs_n < len_k
        k = load_tile(k_ptrs, key_ok, offs_dk < HEAD_DIM_QK, MASKED, HEAD_DIM_QK != BLOCK_D, 0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        # Plain scores (no softcap, bias or ALiBi) are qk times a positive constant: the row max
        # is taken on the raw products and scaled once, and `qk * scale - max` is one FMA per
        # element. Modified scores arrive already scaled (`scores_log2`).
        s = qk
        s_scale = sm_scale * LOG2E
        if HAS_SOFTCAP or HAS_BIAS or HAS_ALIBI:
            s_scale = 1.0
            bias_tile = qk  # placeholder, ignored unless HAS_BIAS
            if HAS_BIAS:
                bias_tile = load_bias_tile(bias_base, qi, kj, stride_bm, stride_bn, len_q, len_k)
            s = scores_log2(
                qk, sm_scale, softcap, bias_tile, alibi_slope, qi, kj, diag,
                HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI,
            )  # fmt: skip
        if MASKED:
            visible = visible_tile(
                qi, kj, diag, window_left, window_right, len_q, len_k,
                HAS_LEFT, HAS_RIGHT, True, False,
            )  # fmt: skip
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
        if MASKED or HAS_BIAS:
            # A row with nothing visible yet has max -inf: shift by 0 so exp2 gives 0, not NaN.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * s_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            # The normalizer counts every weight; dropout only thins what reaches V.
            keep = dropout_keep(seed, offset, bh, qi, kj, dropout_p)
            p = tl.where(keep, p, 0.0)
        v = load_tile(v_ptrs, key_ok, offs_dv < HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV, 0)
        acc = tl.dot(p.to(PV_DTYPE), v.to(PV_DTYPE), acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _program_tile(full_len_q, order_pairs, BLOCK_M: tl.constexpr, REVERSE_M: tl.constexpr):
    """(batch * head index, first query row) of this program on the 1-D grid.

    Query blocks vary fastest: b * h may pass the 65535 limit of grid axis 1, and neighbouring
    programs share one head's K/V in L2. REVERSE_M (causal-like windows) starts the last query
    blocks, which see the most keys, first, interleaved over `order_pairs` consecutive (sequence,
    head) pairs (`_common.causal_order_heads` says why).
    """
    num_m = tl.cdiv(full_len_q, BLOCK_M)
    pid = tl.program_id(0)
    if REVERSE_M:
        bh, i = interleaved_tile(pid, num_m, tl.num_programs(0) // num_m, order_pairs)
        return bh, (num_m - 1 - i) * BLOCK_M
    return pid // num_m, (pid % num_m) * BLOCK_M


@triton.jit
def _normalize(acc, l_i, m_i, dropout_p, HAS_DROPOUT: tl.constexpr):
    """Output rows acc / l (times 1 / (1 - p) with dropout) and the natural-log LSE.

    Rows with no visible key have l = 0 and acc = 0: output 0 and LSE -inf, never 0/0.
    """
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    inv_l = tl.where(has_keys, 1.0 / l_safe, 0.0)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    return acc * inv_l[:, None], lse


@triton.autotune(
    configs=_configs(),
    key=[
        "HEAD_DIM_QK",
        "HEAD_DIM_V",
        "HAS_LEFT",
        "HAS_RIGHT",
        "HAS_BIAS",
        "HAS_DROPOUT",
        "SEQ_BUCKET",
    ],  # fmt: skip
    prune_configs_by={"early_config_prune": _prune_configs},
)
# order_pairs only orders the programs: no specialization on its value (1 or a multiple of 16),
# so one compiled kernel serves every order.
@triton.jit(do_not_specialize=["order_pairs"])
def _attn_fwd(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, bias_ptr, alibi_ptr, descale_ptr,
    cu_q_ptr, offsets_q_ptr, seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ab, stride_ah, stride_db, stride_dh,
    num_heads_q, group, full_len_q, full_len_k, SEQ_BUCKET, order_pairs,
    sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SEQ_MODE_Q: tl.constexpr, SEQ_MODE_K: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_DESCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, PV_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (sequence, query head); writes out and lse rows.

    SEQ_BUCKET (`seq_bucket`) only keys the autotuner; the kernel never reads it. order_pairs:
    the launch order of causal-like windows (`_program_tile`). HAS_DESCALE: fp8 inputs with
    descales, fp32 [b, h_kv, 3] (q, k, v; last dim contiguous) at descale_ptr.
    """
    tl.static_assert(BLOCK_D >= HEAD_DIM_QK and BLOCK_DV >= HEAD_DIM_V)
    bh, start_m = _program_tile(full_len_q, order_pairs, BLOCK_M, HAS_RIGHT)
    z = bh // num_heads_q
    h = bh % num_heads_q
    start_q, len_q = seq_bounds(z, cu_q_ptr, offsets_q_ptr, seqlens_q_ptr, full_len_q, SEQ_MODE_Q)
    if start_m >= len_q:
        return
    start_k, len_k = seq_bounds(z, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, full_len_k, SEQ_MODE_K)
    diag = diagonal_offset(len_q, len_k, BOTTOM_RIGHT)
    # Batch and head offsets in int64: b * s * h * d can pass 2^31 elements.
    z64 = z.to(tl.int64)
    h_kv64 = (h // group).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = (start_q + offs_m).to(tl.int64)
    offs_dk = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q

    h64 = h.to(tl.int64)
    q_ptrs = q_ptr + z64 * stride_qb + h64 * stride_qh
    q_ptrs = q_ptrs + rows[:, None] * stride_qs + offs_dk[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_dk[None, :] < HEAD_DIM_QK), other=0.0)
    k_base = k_ptr + z64 * stride_kb + h_kv64 * stride_kh + start_k.to(tl.int64) * stride_ks
    v_base = v_ptr + z64 * stride_vb + h_kv64 * stride_vh + start_k.to(tl.int64) * stride_vs
    bias_base = bias_ptr  # unused unless HAS_BIAS
    if HAS_BIAS:
        bias_base = bias_ptr + z64 * stride_bb + h64 * stride_bh
    alibi_slope = sm_scale  # a float placeholder, unused unless HAS_ALIBI
    if HAS_ALIBI:
        alibi_slope = tl.load(alibi_ptr + z * stride_ab + h * stride_ah).to(tl.float32)
    v_descale = 1.0
    if HAS_DESCALE:
        # One (sequence, KV head) per program: its descales are constants here. Loaded from the
        # device, so a call never waits on the host for them (CUDA graphs, torch.compile).
        descale = descale_ptr + z64 * stride_db + h_kv64 * stride_dh
        sm_scale = sm_scale * tl.load(descale) * tl.load(descale + 1)
        v_descale = tl.load(descale + 2)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, full_lo, full_hi, hi = key_block_range(
        start_m, diag, window_left, window_right, len_k, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    # Three segments: masked blocks left of the fully visible band, the band, masked blocks right.
    for seg in tl.static_range(3):
        seg_lo = lo if seg == 0 else (full_lo if seg == 1 else full_hi)
        seg_hi = full_lo if seg == 0 else (full_hi if seg == 1 else hi)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q,
            k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd,
            bias_base, stride_bm, stride_bn,
            offs_m, offs_dk, offs_dv, seg_lo, seg_hi,
            diag, window_left, window_right, len_q, len_k,
            sm_scale, softcap, alibi_slope, seed, offset, bh, dropout_p,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, seg != 1, HAS_LEFT, HAS_RIGHT,
            HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION, PV_DTYPE,
        )  # fmt: skip

    out, lse = _normalize(acc, l_i, m_i, dropout_p, HAS_DROPOUT)
    if HAS_DESCALE:
        out = out * v_descale  # P V is linear in V
    o_ptrs = out_ptr + z64 * stride_ob + h64 * stride_oh
    o_ptrs = o_ptrs + rows[:, None] * stride_os + offs_dv[None, :] * stride_od
    o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    l_ptrs = lse_ptr + z64 * stride_lb + h64 * stride_lh + rows * stride_ls
    tl.store(l_ptrs, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

FP8_DTYPE = torch.float8_e4m3fn


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """The forward's output dtype for inputs of `dtype`: bf16 for fp8 (FlashAttention-3's choice:
    an fp8 output would lose the precision the fp32 accumulation kept), else the input's."""
    return torch.bfloat16 if dtype == FP8_DTYPE else dtype


def pv_dtype(dtype: torch.dtype):
    """The Triton dtype P and V meet in for inputs of `dtype` (module docstring, FP8)."""
    if dtype == FP8_DTYPE:
        return tl.float32 if _compat.INTERPRETER else tl.bfloat16
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(dtype, tl.float32)


class ForwardPlan(NamedTuple):
    """What the portable forward's launch derives from a call's signature
    (`_common.attention_signature`, and the forward path setting), made once per signature by
    `_make_plan`. Per call there is left: allocating out and lse, and the argument tuple."""

    sm90: bool  # the sm_90 kernel takes the call (`dispatch.sm90_forward_plan`)
    geometry: LaunchGeometry | None  # `shape_only_geometry`: the sm_90 launch's, where it holds
    pointers: operator.itemgetter  # `seq_pointers` in the kernel's order, None for absent ones
    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    out_dtype: torch.dtype  # `output_dtype` of q's
    owns_all_rows: bool  # else out starts at 0 and lse at -inf (rows no sequence owns)
    grid: Callable[[dict], tuple[int]]
    launches: bool  # some query rows exist: an empty grid is no valid launch
    ints: tuple  # the launch's arguments between its tensors and (seed, offset)
    constexprs: dict
    tuning: tuple  # the key of the autotuner's pick in `_PICKED`
    slot: dict  # `_launch.launch_slot`: the picked config's compiled kernel, bound on first use


# Plans by (signature, forward path, causal order budget); bounded by `remember`.
_PLANS: dict[tuple, ForwardPlan] = {}


def _make_plan(
    q, k, v, *, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q,
    max_seqlen_k, seqlens_q, seqlens_k, softmax_scale, window_left, window_right, bottom_right,
    bias, alibi_slopes, softcap, dropout_p, descale=None, **_unused,
) -> ForwardPlan:  # fmt: skip
    """The forward's plan for this call's signature; reads shapes, strides, dtypes and devices
    only (out and lse, which the launcher allocates, are stood in for by meta tensors)."""
    geom = launch_geometry(
        q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seq_offsets_q=seq_offsets_q,
        seq_offsets_k=seq_offsets_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        seqlens_q=seqlens_q, seqlens_k=seqlens_k,
    )  # fmt: skip
    sm90 = sm90_forward_plan(
        q, k, v, geom, window_left=window_left, window_right=window_right, bias=bias,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
    ) is not None  # fmt: skip
    out_shape = (*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[1], q.shape[0]) if geom.varlen else (q.shape[0], q.shape[2], q.shape[1])
    out, lse = (torch.empty(shape, device="meta") for shape in (out_shape, lse_shape))
    num_heads_q, num_heads_kv = q.shape[-2], k.shape[-2]
    d_qk, d_v = q.shape[-1], v.shape[-1]
    bias_strides = tuple(bias.stride()) if bias is not None else (0, 0, 0, 0)
    alibi_strides = tuple(alibi_slopes.stride()) if alibi_slopes is not None else (0, 0)
    descale_strides = tuple(descale.stride()[:2]) if descale is not None else (0, 0)
    max_q, rows = geom.q.max_len, geom.batch * num_heads_q
    bucket = seq_bucket(max_q, geom.k.max_len)

    def grid(meta):
        return (cdiv(max_q, meta["BLOCK_M"]) * rows,)

    ints = (
        *strides4(q, geom.varlen), *strides4(k, geom.varlen), *strides4(v, geom.varlen),
        *strides4(out, geom.varlen), *lse_strides(lse, geom.varlen),
        *bias_strides, *alibi_strides, *descale_strides,
        num_heads_q, num_heads_q // num_heads_kv, max_q, geom.k.max_len, bucket,
        causal_order_heads(
            geom.k.max_len, head_row_bytes(k, v), num_heads_q // num_heads_kv, rows
        ),
        float(softmax_scale), float(softcap), int(window_left), int(window_right),
        float(dropout_p),
    )  # fmt: skip
    # Tiles at least 64 wide for 16-bit inputs: Triton 3.6 on the H100 hit an illegal address once
    # on an fp16 launch with a 32-wide V tile (d 40 / d_v 24, tiny lengths), not yet isolated
    # (examples/perf/debug_forward_configs.py). Wider tiles take the masked path every head dim in
    # 33..64 takes on the GPU tests; the cost is extra tensor-core work for d <= 32 only. fp8
    # inputs too: their P V product is bf16 (and an fp8 dot needs K >= 32).
    min_width = 16 if q.element_size() == 4 else 64
    constexprs = dict(
        HEAD_DIM_QK=d_qk, HEAD_DIM_V=d_v,
        BLOCK_D=max(min_width, next_pow2_dim(d_qk)), BLOCK_DV=max(min_width, next_pow2_dim(d_v)),
        SEQ_MODE_Q=geom.q.mode, SEQ_MODE_K=geom.k.mode, BOTTOM_RIGHT=bool(bottom_right),
        HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_BIAS=bias is not None, HAS_ALIBI=alibi_slopes is not None,
        HAS_DROPOUT=dropout_p > 0, HAS_DESCALE=descale is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PV_DTYPE=pv_dtype(q.dtype),
    )  # fmt: skip
    # The autotuner's key, finer: every constexpr, every tensor argument's dtype in argument
    # order (out has `output_dtype`'s, lse fp32), and the length bucket (`_launch`).
    pointers = seq_pointers(geom, (0, 2, 4, 1, 3, 5))
    seq = pointers((cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, seqlens_q,
                    seqlens_k, None))  # fmt: skip
    out_dtype = output_dtype(q.dtype)
    dtypes = (q.dtype, k.dtype, v.dtype, out_dtype, torch.float32,
              *(t.dtype for t in (bias, alibi_slopes, descale, *seq) if t is not None))  # fmt: skip
    return ForwardPlan(
        sm90=sm90, geometry=shape_only_geometry(geom), pointers=pointers,
        out_shape=out_shape, lse_shape=lse_shape, out_dtype=out_dtype,
        owns_all_rows=geom.q.owns_all_rows,
        grid=grid, launches=max_q * rows > 0, ints=ints,
        constexprs=constexprs, tuning=(tuple(constexprs.values()), dtypes, bucket),
        slot=launch_slot(),
    )  # fmt: skip


def _plan(call: dict) -> ForwardPlan:
    """The plan of a call (`flash_attention_forward`'s parameters by name), made on a miss;
    fills in `call["signature"]` when the caller gave none."""
    if call["signature"] is None:
        call["signature"] = attention_signature(**call)
    key = (call["signature"], forward_path(), _common.CAUSAL_ORDER_L2_BYTES)
    plan = _PLANS.get(key)
    if plan is None:
        plan = remember(_PLANS, key, _make_plan(**call), MAX_PLANS)
    return plan


def _outputs_and_args(plan: ForwardPlan, call: dict) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(out, lse, the launch's positional arguments) for one call of a plan."""
    q = call["q"]
    if plan.owns_all_rows:
        out = empty(plan.out_shape, plan.out_dtype, q.device)
        lse = empty(plan.lse_shape, torch.float32, q.device)
    else:  # rows no sequence owns are never written
        out = zeros(plan.out_shape, plan.out_dtype, q.device)
        lse = torch.full(plan.lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    seq = plan.pointers(
        (call["cu_seqlens_q"], call["cu_seqlens_k"], call["seq_offsets_q"],
         call["seq_offsets_k"], call["seqlens_q"], call["seqlens_k"], None)
    )  # fmt: skip
    args = (q, call["k"], call["v"], out, lse, call["bias"], call["alibi_slopes"],
            call["descale"], *seq,
            *plan.ints, *seed_offset((call["seed"], call["offset"])))  # fmt: skip
    return out, lse, args


def forward_launch(
    q, k, v, *,
    cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k,
    seqlens_q, seqlens_k, softmax_scale, window_left, window_right, bottom_right,
    bias, alibi_slopes, softcap, dropout_p, seed, offset, descale=None, signature=None,
):  # fmt: skip
    """Everything `_attn_fwd` needs: (out, lse, grid, args, constexprs), outputs allocated.

    Split from the launch so tools can run one explicit config (`_attn_fwd.fn[grid](...)`);
    the constexprs are the caller's to change. `signature`: the call's `attention_signature`
    when the caller has it already (it is computed from the same arguments otherwise).
    """
    call = locals()  # every parameter by name
    plan = _plan(call)
    out, lse, args = _outputs_and_args(plan, call)
    return out, lse, plan.grid, args, dict(plan.constexprs)


def flash_attention_forward(
    q, k, v, *,
    cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k,
    seqlens_q, seqlens_k, softmax_scale, window_left, window_right, bottom_right,
    bias, alibi_slopes, softcap, dropout_p, seed, offset, descale=None, signature=None,
):  # fmt: skip
    """Attention forward on validated input; returns (out, lse).

    q [b, s_q, h_q, d_qk] / [t_q, h_q, d_qk]; k [.., h_kv, d_qk]; v [.., h_kv, d_v], any strides
    with stride(-1) == 1. Varlen when cu_seqlens_q is given (int32 [b+1], with max_seqlen_q/k and
    optional seq_offsets_q/k int32 [b+1]); dense padding through seqlens_q/k int32 [b].
    window_left/right: -1 = unbounded; bottom_right aligns the diagonal to the last key.
    bias: [b, h_q, s_q, s_k] view (any strides, 0 for broadcast dims; varlen: positions within each
    sequence), any float dtype. alibi_slopes: [b, h_q] view (stride_b may be 0). softcap > 0 caps.
    dropout_p > 0 drops with the keep-mask of `dropout_keep_mask((seed, offset), ...)`.
    q, k, v in float8_e4m3fn (all three; sm_89+ or the interpreter): descale None (all 1) or
    fp32 [b, h_kv, 3], the q, k and v descales of each (sequence, KV head), last dim contiguous.
    Returns out [.., h_q, d_v] (q's dtype; bf16 for fp8) and lse fp32 (dense [b, h_q, s_q] /
    varlen [h_q, t_q]). `signature`: the call's `_common.attention_signature` when the caller
    has it already.

    On an sm_90 GPU the calls the warp-specialized Gluon kernel covers run there instead
    (`dispatch`; never fp8); the outputs are the same either way. Everything the launch derives from
    the call's signature is planned once per signature (`ForwardPlan`).
    """
    call = locals()  # every parameter by name
    plan = _plan(call)
    if plan.sm90:
        geom = plan.geometry
        if geom is None:
            geom = launch_geometry(
                q, k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                seq_offsets_q=seq_offsets_q, seq_offsets_k=seq_offsets_k,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqlens_q=seqlens_q,
                seqlens_k=seqlens_k,
            )  # fmt: skip
        return run_sm90_forward(
            q, k, v, geom, causal=window_right == 0, softmax_scale=softmax_scale,
            bottom_right=bottom_right, signature=call["signature"],
        )  # fmt: skip
    out, lse, args = _outputs_and_args(plan, call)
    if plan.launches:
        _launch(plan.grid, args, plan.constexprs, call["signature"], plan.tuning, plan.slot)
    return out, lse


# The autotuner's pick per launch signature, remembered here so later launches skip
# `Autotuner.run`: it rebuilds its key on every call, testing each of ~60 argument names for
# membership in a list, ~100 us of host time per launch on the H100's host (cProfile, Triton
# 3.6), more than the kernel itself at s = 1k. The tuning key (every constexpr, every tensor
# argument's dtype, and the length bucket; `ForwardPlan.tuning`) is finer than the autotuner's
# key, so each entry maps to one of its picks.
_PICKED: dict[tuple, triton.Config] = {}


def _launch(
    grid, args, constexprs, signature: tuple | None, tuning: tuple, slot: dict | None = None
) -> None:
    """`_attn_fwd[grid](...)`, through the autotuner only the first time per `tuning` key.
    `signature`: the call's `attention_signature`, handed to `launch`; `slot`: the plan's,
    which never sees the autotuner's trial launches (each pick gets its part, `config_slot`)."""
    config = _PICKED.get(tuning)
    if config is None:
        _attn_fwd[grid](*args, **constexprs)
        _PICKED[tuning] = _attn_fwd.best_config
    else:
        part = None if slot is None else config_slot(slot, config)
        if not launch_bound(part, args):
            launch(_attn_fwd.fn, grid, *args, **constexprs, **config.all_kwargs(),
                   signature=signature, slot=part)  # fmt: skip
