"""Flash-attention backward, dQ half: one program per (query block, query head, sequence).

Each program recomputes its score tiles against every key block it can see and sums dQ in
registers; on short sequences it first computes its rows' delta = rowsum(dO * O) (minus the
LSE's upstream gradient, `HAS_DLSE`) for the dK/dV pass that then follows it (`DELTA_IN_DQ`).
It is also the one writer of dBias: every (i, j) score element belongs to exactly one of these
programs, so no atomics are needed there either.
"""

import triton
import triton.language as tl

from ._common import (
    LOG2E,
    delta_minus_dlse,
    diagonal_offset,
    dim_mask,
    dropout_keep,
    interleaved_tile,
    key_block_range,
    load_bias_tile,
    load_tile,
    scores_log2,
    seq_bounds,
    tanh_f32,
    visible_tile,
)


@triton.jit
def _dq_block(
    dq, q, do, lse2, delta, k_head, v_head, bias_head, dbias_head,
    slope, start_n, offs_m, offs_dq, offs_dv, len_q, len_k, diag, bh,
    stride_ks, stride_vs, stride_bm, stride_bn, stride_dbm, stride_dbn,
    dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PAD_QK: tl.constexpr, PAD_V: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_DBIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Add one key block's dS @ K to dq [BLOCK_M, HEAD_DIM_QK] (unscaled); write its dBias.

    q [BLOCK_M, HEAD_DIM_QK], do [BLOCK_M, HEAD_DIM_V], lse2 (log2 domain) and delta [BLOCK_M]
    stay resident. MASKED=False is only used for blocks proved fully visible and in bounds, whose
    K/V rows load unmasked; `dq_ok` / `dv_ok` mask the head dim only where PAD_QK / PAD_V.
    """
    offs_nb = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_nb
    key_ok = offs_n < len_k
    # The block's first row in int64 (start_n * stride can pass 2^31), the rows within it in
    # int32 (int64 index tiles cost address registers).
    k_blk = k_head + tl.cast(start_n, tl.int64) * stride_ks  # (interpreter: start_n is an int)
    k = load_tile(
        k_blk + offs_nb[:, None] * stride_ks + offs_dq[None, :], key_ok, dq_ok, MASKED, PAD_QK, 0
    )  # fmt: skip
    v_blk = v_head + tl.cast(start_n, tl.int64) * stride_vs
    v = load_tile(
        v_blk + offs_nb[:, None] * stride_vs + offs_dv[None, :], key_ok, dv_ok, MASKED, PAD_V, 0
    )  # fmt: skip
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    qi, kj = offs_m[:, None], offs_n[None, :]  # query-major index tiles (`_common` legend)
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
    p = tl.math.exp2(s2 - lse2[:, None])

    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    if HAS_DROPOUT:
        keep = dropout_keep(seed, offset, bh, qi, kj, dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    if WRITE_DBIAS:
        # The bias is added after softcap, so its gradient is dS before the tanh chain rule.
        tl.store(
            dbias_head + offs_m[:, None].to(tl.int64) * stride_dbm + offs_n[None, :] * stride_dbn,
            ds.to(dbias_head.dtype.element_ty),
            mask=(offs_m[:, None] < len_q) & (offs_n[None, :] < len_k),
        )
    if HAS_SOFTCAP:
        # Chain rule through softcap * tanh(x / softcap): the derivative is 1 - tanh^2.
        t = tanh_f32(qk * (sm_scale / softcap))
        ds = ds * (1.0 - t * t)
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_rows(
    dq, q, do, lse2, delta, k_head, v_head, bias_head, dbias_head,
    slope, start_m, offs_m, offs_dq, offs_dv, len_q, len_k, diag, bh,
    stride_ks, stride_vs, stride_bm, stride_bn, stride_dbm, stride_dbn,
    dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAD_QK: tl.constexpr, PAD_V: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_DBIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """All key blocks for one query block: masked edge, unmasked interior, masked edge.

    Key blocks outside [lo, hi) are invisible to every row of the block and are skipped.
    """
    lo, full_lo, full_hi, hi = key_block_range(
        start_m, diag, window_left, window_right, len_k, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    if start_m + BLOCK_M > len_q:
        # The last query block hangs past len_q: every tile needs the query bound.
        full_lo = hi
        full_hi = hi
    for start_n in range(lo, full_lo, BLOCK_N):
        dq = _dq_block(
            dq, q, do, lse2, delta, k_head, v_head, bias_head, dbias_head,
            slope, start_n, offs_m, offs_dq, offs_dv, len_q, len_k, diag, bh,
            stride_ks, stride_vs, stride_bm, stride_bn, stride_dbm, stride_dbn,
            dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
            BLOCK_N, True, PAD_QK, PAD_V, HAS_LEFT, HAS_RIGHT, HAS_BIAS, WRITE_DBIAS, HAS_ALIBI,
            HAS_SOFTCAP, HAS_DROPOUT, DOT_PRECISION,
        )  # fmt: skip
    for start_n in range(full_lo, full_hi, BLOCK_N):
        dq = _dq_block(
            dq, q, do, lse2, delta, k_head, v_head, bias_head, dbias_head,
            slope, start_n, offs_m, offs_dq, offs_dv, len_q, len_k, diag, bh,
            stride_ks, stride_vs, stride_bm, stride_bn, stride_dbm, stride_dbn,
            dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
            BLOCK_N, False, PAD_QK, PAD_V, HAS_LEFT, HAS_RIGHT, HAS_BIAS, WRITE_DBIAS, HAS_ALIBI,
            HAS_SOFTCAP, HAS_DROPOUT, DOT_PRECISION,
        )  # fmt: skip
    for start_n in range(full_hi, hi, BLOCK_N):
        dq = _dq_block(
            dq, q, do, lse2, delta, k_head, v_head, bias_head, dbias_head,
            slope, start_n, offs_m, offs_dq, offs_dv, len_q, len_k, diag, bh,
            stride_ks, stride_vs, stride_bm, stride_bn, stride_dbm, stride_dbn,
            dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
            BLOCK_N, True, PAD_QK, PAD_V, HAS_LEFT, HAS_RIGHT, HAS_BIAS, WRITE_DBIAS, HAS_ALIBI,
            HAS_SOFTCAP, HAS_DROPOUT, DOT_PRECISION,
        )  # fmt: skip
    return dq


# ORDER_PAIRS only orders the programs: one compiled kernel for every value.
@triton.jit(do_not_specialize=["ORDER_PAIRS"])
def _flash_bwd_dq_kernel(
    Q, K, V, DO, OUT, LSE, DELTA, DLSE, DQ, BIAS, DBIAS, ALIBI,
    CU_Q, CU_K, OFF_Q, OFF_K, LENS_Q, LENS_K,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls, stride_dqb, stride_dqs, stride_dqh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dbb, stride_dbh, stride_dbm, stride_dbn, stride_ab, stride_ah,
    ORDER_PAIRS, H_Q, H_KV, MAX_Q, MAX_K, D_QK, D_V,
    sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, PAD_QK: tl.constexpr, PAD_V: tl.constexpr,
    SEQ_MODE_Q: tl.constexpr, SEQ_MODE_K: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    WRITE_DBIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, DELTA_IN_DQ: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """dQ (and dBias) for one query block of one query head; head h reads KV head h // group.

    Grid: (cdiv(MAX_Q, BLOCK_M) * batch * H_Q,). dQ leaves already multiplied by sm_scale.
    DELTA_IN_DQ: each program computes its rows' delta = rowsum(dO * O) (fp32) from OUT and
    stores it to DELTA (laid out like the LSE) for the dK/dV pass, which then runs after this
    one, in place of the preprocess; every row of a sequence belongs to one program, which runs
    whatever its rows see. HAS_DLSE (with DELTA_IN_DQ only) subtracts the LSE's upstream gradient
    DLSE (laid out like the LSE) from it. Otherwise it reads DELTA, which the preprocess wrote
    (OUT and DLSE unread).
    """
    # A 1-D grid, query blocks fastest: batch * heads may pass the 65535 limit of grid axis 1, and
    # neighbouring programs share one head's K/V in L2.
    num_m = tl.cdiv(MAX_Q, BLOCK_M)
    if HAS_RIGHT:
        # Causal-like windows: the last query blocks see the most keys; start them first,
        # interleaved over ORDER_PAIRS (sequence, head) pairs (`_common.interleaved_tile`).
        pid_zh, i = interleaved_tile(
            tl.program_id(0), num_m, tl.num_programs(0) // num_m, ORDER_PAIRS
        )
        m_idx = num_m - 1 - i
    else:
        pid_zh = tl.program_id(0) // num_m
        m_idx = tl.program_id(0) % num_m
    start_m = m_idx * BLOCK_M
    # Lengths and positions within a sequence stay int32 (the loops and masks run on them);
    # batch, head and row offsets into memory are int64: b * s * h * d can pass 2^31 elements.
    z32 = pid_zh // H_Q
    start_q, len_q = seq_bounds(z32, CU_Q, OFF_Q, LENS_Q, MAX_Q, SEQ_MODE_Q)
    start_k, len_k = seq_bounds(z32, CU_K, OFF_K, LENS_K, MAX_K, SEQ_MODE_K)
    z = z32.to(tl.int64)
    h = (pid_zh % H_Q).to(tl.int64)
    h_kv = h // (H_Q // H_KV)
    if start_m >= len_q:
        return
    rows = start_q.to(tl.int64) + start_m + tl.arange(0, BLOCK_M)
    start_k = start_k.to(tl.int64)
    diag = diagonal_offset(len_q, len_k, BOTTOM_RIGHT)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dq = tl.arange(0, HEAD_DIM_QK)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    dq_ok = dim_mask(offs_dq, D_QK, PAD_QK)
    dv_ok = dim_mask(offs_dv, D_V, PAD_V)
    row_ok = offs_m < len_q
    q_ptrs = Q + z * stride_qb + h * stride_qh + rows[:, None] * stride_qs
    q = load_tile(q_ptrs + offs_dq[None, :], row_ok, dq_ok, True, PAD_QK, 0)
    do_ptrs = DO + z * stride_dob + h * stride_doh + rows[:, None] * stride_dos
    do = load_tile(do_ptrs + offs_dv[None, :], row_ok, dv_ok, True, PAD_V, 0)
    lse_at = z * stride_lb + h * stride_lh + rows * stride_ls
    lse = tl.load(LSE + lse_at, mask=row_ok, other=0.0)
    # Rows that saw no key carry LSE -inf and only -inf scores: any finite stand-in gives P = 0
    # instead of exp2(-inf + inf) = NaN.
    lse2 = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    if DELTA_IN_DQ:
        o_ptrs = OUT + z * stride_ob + h * stride_oh + rows[:, None] * stride_os
        o = load_tile(o_ptrs + offs_dv[None, :], row_ok, dv_ok, True, PAD_V, 0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        if HAS_DLSE:
            delta = delta_minus_dlse(delta, lse, tl.load(DLSE + lse_at, mask=row_ok, other=0.0))
        tl.store(DELTA + lse_at, delta, mask=row_ok)
    else:
        delta = tl.load(DELTA + lse_at, mask=row_ok, other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + z * stride_ab + h * stride_ah)

    dq = _dq_rows(
        tl.zeros([BLOCK_M, HEAD_DIM_QK], dtype=tl.float32), q, do, lse2, delta,
        K + z * stride_kb + h_kv * stride_kh + start_k * stride_ks,
        V + z * stride_vb + h_kv * stride_vh + start_k * stride_vs,
        BIAS + z * stride_bb + h * stride_bh, DBIAS + z * stride_dbb + h * stride_dbh,
        slope, start_m, offs_m, offs_dq, offs_dv, len_q, len_k, diag, z * H_Q + h,
        stride_ks, stride_vs, stride_bm, stride_bn, stride_dbm, stride_dbn,
        dq_ok, dv_ok, sm_scale, softcap, window_left, window_right, dropout_p, seed, offset,
        BLOCK_M, BLOCK_N, PAD_QK, PAD_V, HAS_LEFT, HAS_RIGHT, HAS_BIAS, WRITE_DBIAS, HAS_ALIBI,
        HAS_SOFTCAP, HAS_DROPOUT, DOT_PRECISION,
    )  # fmt: skip
    dq_ptrs = DQ + z * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqs
    tl.store(dq_ptrs + offs_dq[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & dq_ok[None, :])  # fmt: skip
