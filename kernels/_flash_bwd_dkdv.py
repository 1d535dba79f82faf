"""Flash-attention backward, dK/dV half: one program per (key block, KV head, sequence).

Each program keeps its key/value tile and the dK/dV accumulators in registers and loops over
every query head of its GQA group and every query block that can see the tile, so the group sum
happens in registers: no expanded [b, s, h_q, d] buffer and no atomics, hence bitwise
deterministic dK/dV.

With ATOMIC_DQ (the launcher's non-deterministic path, FlashAttention-2's scheme) each query
block also adds its dS^T K share to an fp32 dQ accumulator with atomics, so no separate dQ pass
has to recompute Q K^T and dO V^T; the order of those adds varies run to run, so dQ is then not
bitwise reproducible. Without it the kernel is the first of the two-pass (deterministic) scheme
and the dQ code is not compiled at all.

Score tiles here are key-major, [BLOCK_N, BLOCK_M] (keys are rows): q^T and dO^T are read
transposed through their strides, so P^T and dS^T come straight out of the products and feed the
dV and dK products with no transpose of a register tile. The masks, bias, ALiBi term and dropout
draws come from the same `_common.py` helpers as the forward's, given key-major index tiles, so
forward and backward mask, modify and drop exactly the same elements, also without a transpose.
"""

import triton
import triton.language as tl

from ._common import (
    LOG2E,
    diagonal_offset,
    dim_mask,
    dropout_keep,
    interleaved_tile,
    load_bias_tile,
    load_tile,
    query_block_range,
    scores_log2,
    seq_bounds,
    tanh_f32,
    visible_tile,
)


@triton.jit
def _dkdv_block(
    dk, dv, k, v, q_head, do_head, lse_head, delta_head, bias_head, dq_head,
    slope, start_m, offs_n, offs_dq, offs_dv, len_q, len_k, diag, bh,
    stride_qs, stride_dos, stride_ls, stride_bm, stride_bn, stride_dqs,
    dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, PAD_QK: tl.constexpr, PAD_V: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):  # fmt: skip
    """Add one query block's share to dk [BLOCK_N, HEAD_DIM_QK] and dv [BLOCK_N, HEAD_DIM_V].

    k [BLOCK_N, HEAD_DIM_QK], v [BLOCK_N, HEAD_DIM_V] are the resident key/value tiles; `*_head`
    pointers point at row 0 of this sequence and query head. MASKED=False is only used for
    blocks the launcher proved fully visible and in bounds, where the mask is skipped and the
    q/dO rows load unmasked. `dq_ok` / `dv_ok` are the head-dim masks (`dim_mask`), applied only
    where PAD_QK / PAD_V say the head dim is padded.
    ATOMIC_DQ: also add this block's unscaled dS @ K to the fp32 dQ accumulator at `dq_head`
    (rows [start_m, start_m + BLOCK_M), row stride `stride_dqs`); otherwise `dq_head` and
    `stride_dqs` are unused.
    """
    offs_mb = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_mb
    row_ok = offs_m < len_q
    # The block's first row in int64 (start_m * stride can pass 2^31), the rows within it in
    # int32: int64 index tiles doubled the address registers and made this kernel spill.
    row0 = tl.cast(start_m, tl.int64)  # tl.cast: the interpreter hands loop indices as ints
    q_blk = q_head + row0 * stride_qs
    q_t = load_tile(
        q_blk + offs_mb[None, :] * stride_qs + offs_dq[:, None], row_ok, dq_ok, MASKED, PAD_QK, 1
    )  # fmt: skip
    do_blk = do_head + row0 * stride_dos
    do = load_tile(
        do_blk + offs_mb[:, None] * stride_dos + offs_dv[None, :], row_ok, dv_ok, MASKED, PAD_V, 0
    )  # fmt: skip
    lse_blk = lse_head + row0 * stride_ls
    lse = tl.load(lse_blk + offs_mb * stride_ls, mask=row_ok, other=0.0)
    # Rows that saw no key carry LSE -inf and only -inf scores: any finite stand-in gives P = 0
    # instead of exp2(-inf + inf) = NaN.
    lse2 = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    delta_blk = delta_head + row0 * stride_ls  # laid out like the LSE
    delta = tl.load(delta_blk + offs_mb * stride_ls, mask=row_ok, other=0.0)

    qk = tl.dot(k, q_t, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    qi, kj = offs_m[None, :], offs_n[:, None]  # key-major index tiles (`_common` legend)
    bias = 0.0
    if HAS_BIAS:
        bias = load_bias_tile(bias_head, qi, kj, stride_bm, stride_bn, len_q, len_k)
    s2 = scores_log2(
        qk, sm_scale, softcap, bias, slope, qi, kj, diag, HAS_SOFTCAP, HAS_BIAS, HAS_ALIBI
    )
    if MASKED:
        vis = visible_tile(
            qi, kj, diag, window_left, window_right, len_q, len_k,
            HAS_LEFT, HAS_RIGHT, True, True,
        )  # fmt: skip
        s2 = tl.where(vis, s2, float("-inf"))
    p = tl.math.exp2(s2 - lse2[None, :])

    if HAS_DROPOUT:
        keep = dropout_keep(seed, offset, bh, qi, kj, dropout_p)
        rescale = 1.0 / (1.0 - dropout_p)
        # dV sees the dropped, rescaled probabilities; dP flows back through the same mask.
        dv += tl.dot(tl.where(keep, p * rescale, 0.0).to(do.dtype), do,
                     input_precision=DOT_PRECISION)  # fmt: skip
        dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        dp = tl.where(keep, dp * rescale, 0.0)
    else:
        dv += tl.dot(p.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    ds = p * (dp - delta[None, :])
    if HAS_SOFTCAP:
        # Chain rule through softcap * tanh(x / softcap): the derivative is 1 - tanh^2.
        t = tanh_f32(qk * (sm_scale / softcap))
        ds = ds * (1.0 - t * t)
    ds_lo = ds.to(q_t.dtype)
    dk += tl.dot(ds_lo, tl.trans(q_t), input_precision=DOT_PRECISION)
    if ATOMIC_DQ:
        # dS is key-major: its transpose times the resident K tile is this key block's share of
        # the query rows' dQ. Every key block's program adds to the same rows (GQA adds nothing:
        # each query head has its own rows), hence fp32 atomics; no program reads the
        # accumulator, so relaxed ordering suffices.
        dq = tl.dot(tl.trans(ds_lo), k, input_precision=DOT_PRECISION)  # [BLOCK_M, HEAD_DIM_QK]
        tl.atomic_add(
            dq_head + row0 * stride_dqs + offs_mb[:, None] * stride_dqs + offs_dq[None, :], dq,
            mask=row_ok[:, None] & dq_ok[None, :], sem="relaxed",
        )  # fmt: skip
    return dk, dv


@triton.jit
def _dkdv_head(
    dk, dv, k, v, q_head, do_head, lse_head, delta_head, bias_head, dq_head,
    slope, start_n, offs_n, offs_dq, offs_dv, len_q, len_k, diag, bh,
    stride_qs, stride_dos, stride_ls, stride_bm, stride_bn, stride_dqs,
    dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAD_QK: tl.constexpr, PAD_V: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):  # fmt: skip
    """One query head's contribution: masked edge blocks, unmasked interior, masked edge.

    Query blocks outside [lo, hi) see none of this program's keys and are skipped.
    """
    lo, full_lo, full_hi, hi = query_block_range(
        start_n, diag, window_left, window_right, len_q, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    if start_n + BLOCK_N > len_k:
        # The last key block hangs past len_k: every tile needs the key bound.
        full_lo = hi
        full_hi = hi
    for start_m in range(lo, full_lo, BLOCK_M):
        dk, dv = _dkdv_block(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, bias_head, dq_head,
            slope, start_m, offs_n, offs_dq, offs_dv, len_q, len_k, diag, bh,
            stride_qs, stride_dos, stride_ls, stride_bm, stride_bn, stride_dqs,
            dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
            BLOCK_M, True, PAD_QK, PAD_V, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
            HAS_DROPOUT, DOT_PRECISION, ATOMIC_DQ,
        )  # fmt: skip
    for start_m in range(full_lo, full_hi, BLOCK_M):
        dk, dv = _dkdv_block(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, bias_head, dq_head,
            slope, start_m, offs_n, offs_dq, offs_dv, len_q, len_k, diag, bh,
            stride_qs, stride_dos, stride_ls, stride_bm, stride_bn, stride_dqs,
            dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
            BLOCK_M, False, PAD_QK, PAD_V, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
            HAS_DROPOUT, DOT_PRECISION, ATOMIC_DQ,
        )  # fmt: skip
    for start_m in range(full_hi, hi, BLOCK_M):
        dk, dv = _dkdv_block(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head, bias_head, dq_head,
            slope, start_m, offs_n, offs_dq, offs_dv, len_q, len_k, diag, bh,
            stride_qs, stride_dos, stride_ls, stride_bm, stride_bn, stride_dqs,
            dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
            BLOCK_M, True, PAD_QK, PAD_V, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
            HAS_DROPOUT, DOT_PRECISION, ATOMIC_DQ,
        )  # fmt: skip
    return dk, dv


# ORDER_PAIRS only orders the programs: one compiled kernel for every value.
@triton.jit(do_not_specialize=["ORDER_PAIRS"])
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, BIAS, ALIBI, DQ_ACC,
    CU_Q, CU_K, OFF_Q, OFF_K, LENS_Q, LENS_K,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh, stride_ls, stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_bb, stride_bh, stride_bm, stride_bn, stride_ab, stride_ah,
    stride_dqb, stride_dqs, stride_dqh, stride_dk_split, stride_dv_split,
    ORDER_PAIRS, H_Q, H_KV, GROUP_SPLITS, MAX_Q, MAX_K, D_QK, D_V,
    sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    PAD_QK: tl.constexpr, PAD_V: tl.constexpr,
    SEQ_MODE_Q: tl.constexpr, SEQ_MODE_K: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):  # fmt: skip
    """dK and dV for one key block of one KV head, summed over the GQA group (or one share of it).

    Grid: (cdiv(MAX_K, BLOCK_N) * GROUP_SPLITS * batch * H_KV,). With GROUP_SPLITS > 1 the group's
    query heads are dealt out in GROUP_SPLITS contiguous shares, one program each, and share i
    writes its partial sums at DK + i * stride_dk_split (fp32 buffers the launcher adds up);
    otherwise the split strides are unused. dK leaves already multiplied by sm_scale.
    ATOMIC_DQ: also add the unscaled dQ shares to DQ_ACC (fp32, laid out like q, zero-filled by
    the launcher, strides (batch, row, head)); without it DQ_ACC is a dummy, never touched.
    """
    # A 1-D grid, key blocks fastest: batch * heads may pass the 65535 limit of grid axis 1, and
    # neighbouring programs share one group's q/dO in L2. Under causal-like windows the first key
    # blocks see the most queries, so they also start first, interleaved over ORDER_PAIRS
    # (sequence, KV head, share) triples (`_common.interleaved_tile`).
    num_n = tl.cdiv(MAX_K, BLOCK_N)
    if HAS_RIGHT:
        pid_rest, n_idx = interleaved_tile(
            tl.program_id(0), num_n, tl.num_programs(0) // num_n, ORDER_PAIRS
        )
    else:
        pid_rest = tl.program_id(0) // num_n
        n_idx = tl.program_id(0) % num_n
    start_n = n_idx * BLOCK_N
    split = pid_rest % GROUP_SPLITS
    pid_zh = pid_rest // GROUP_SPLITS
    # Lengths and positions within a sequence stay int32 (the loops and masks run on them);
    # batch, head and row offsets into memory are int64: b * s * h * d can pass 2^31 elements.
    z32 = pid_zh // H_KV
    start_q, len_q = seq_bounds(z32, CU_Q, OFF_Q, LENS_Q, MAX_Q, SEQ_MODE_Q)
    start_k, len_k = seq_bounds(z32, CU_K, OFF_K, LENS_K, MAX_K, SEQ_MODE_K)
    z = z32.to(tl.int64)
    h_kv = (pid_zh % H_KV).to(tl.int64)
    if start_n >= len_k:
        return
    start_q = start_q.to(tl.int64)
    start_k = start_k.to(tl.int64)
    diag = diagonal_offset(len_q, len_k, BOTTOM_RIGHT)
    group = H_Q // H_KV
    share = tl.cdiv(group, GROUP_SPLITS)
    g_lo = split * share
    g_hi = tl.minimum(g_lo + share, group)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dq = tl.arange(0, HEAD_DIM_QK)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    dq_ok = dim_mask(offs_dq, D_QK, PAD_QK)
    dv_ok = dim_mask(offs_dv, D_V, PAD_V)
    key_ok = offs_n < len_k
    col_ok = key_ok[:, None]
    k_ptrs = K + z * stride_kb + h_kv * stride_kh + (start_k + offs_n[:, None]) * stride_ks
    k = load_tile(k_ptrs + offs_dq[None, :], key_ok, dq_ok, True, PAD_QK, 0)
    v_ptrs = V + z * stride_vb + h_kv * stride_vh + (start_k + offs_n[:, None]) * stride_vs
    v = load_tile(v_ptrs + offs_dv[None, :], key_ok, dv_ok, True, PAD_V, 0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_QK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    for g in range(g_lo, g_hi):
        h = h_kv * group + g
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(ALIBI + z * stride_ab + h * stride_ah)
        lse_at = z * stride_lb + h * stride_lh + start_q * stride_ls
        dk, dv = _dkdv_head(
            dk, dv, k, v,
            Q + z * stride_qb + h * stride_qh + start_q * stride_qs,
            DO + z * stride_dob + h * stride_doh + start_q * stride_dos,
            LSE + lse_at, DELTA + lse_at, BIAS + z * stride_bb + h * stride_bh,
            DQ_ACC + z * stride_dqb + h * stride_dqh + start_q * stride_dqs,
            slope, start_n, offs_n, offs_dq, offs_dv, len_q, len_k, diag, z * H_Q + h,
            stride_qs, stride_dos, stride_ls, stride_bm, stride_bn, stride_dqs,
            dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
            BLOCK_M, BLOCK_N, PAD_QK, PAD_V, HAS_LEFT, HAS_RIGHT, HAS_BIAS, HAS_ALIBI,
            HAS_SOFTCAP, HAS_DROPOUT, DOT_PRECISION, ATOMIC_DQ,
        )  # fmt: skip
    dk_ptrs = DK + split.to(tl.int64) * stride_dk_split + z * stride_dkb + h_kv * stride_dkh
    dk_ptrs += (start_k + offs_n[:, None]) * stride_dks
    tl.store(
        dk_ptrs + offs_dq[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
        mask=col_ok & dq_ok[None, :],
    )  # fmt: skip
    dv_ptrs = DV + split.to(tl.int64) * stride_dv_split + z * stride_dvb + h_kv * stride_dvh
    dv_ptrs += (start_k + offs_n[:, None]) * stride_dvs
    tl.store(
        dv_ptrs + offs_dv[None, :], dv.to(DV.dtype.element_ty),
        mask=col_ok & dv_ok[None, :],
    )  # fmt: skip
