"""The consumer warpgroups of the sm_90 backward at tile width 256 (d = 192 and 256, and
(d_qk, d_v) = (192, 128)): a prototype, compiled offline only (docs/design-sm90-backward-wide.md
has the design, the register and shared-memory budgets and the costs).

One program owns BLOCK_N = 64 keys; both consumer warpgroups work on all 64 of them, each
holding half of dK's and of dV's columns ([64 keys, W/2] fp32: 64 + 64 registers a thread at
W = 256, d = 128's count). Per step of BLOCK_M = 64 query rows, warpgroup w:
1. S^T = K Q_w^T and dP^T = V dO_w^T for its 32 query rows ([64 keys, 32 queries], over the
   dim's own columns), then P^T and dS^T, stored as rows 32w.. of the query-major tiles
   P [64 queries, 64 keys] and dS [64, 64] (double-buffered by step parity);
2. after both warpgroups' halves are written (an mbarrier both arrive on): dV_w += P^T dO[:, w],
   dK_w += dS^T Q[:, w] and dQ[:, w] = dS K[:, w] over its W/2 columns, all three A operands
   from shared memory; the stage goes back to the producer once dV and dK land;
3. its dQ share [64 queries, W/2] reduced into the fp32 accumulator by one TMA reduce-add
   (`_reduce_dq`) from its staging tile.

Shapes and the rest of the schedule (producer, masks, rows past a sequence's end, the dQ
accumulator's padding columns) are as in `_flash_bwd_sm90`'s docstring.
"""

from __future__ import annotations

from ._sm90_common import GLUON_AVAILABLE

if GLUON_AVAILABLE:
    from ._flash_bwd_sm90_steps import (
        _dscores,
        _opaque_zero,
        _probs,
        _reduce_dq,
    )
    from ._sm90_common import (
        _partition_barrier,
        _product_over_dim,
        _release,
        _zero_rows_from,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    @gluon.jit
    def _consumer_wide(
        args, WG: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
        DV_EARLY: gl.constexpr,
    ):  # fmt: skip
        """Warpgroup WG: columns [WG * W/2, (WG + 1) * W/2) of dK and dV (W, W_v: the q/k and
        v/dO tiles' widths) for the program's 64 keys, and the same columns of each step's dQ
        share. `args`: the producer's argument list (`_flash_bwd_sm90._attn_bwd_sm90`);
        HEAD_DIM, HEAD_DIM_V: q's and v's head dims, the columns the score products sum over
        and dK and dV store. Variants (`_flash_bwd_sm90.WIDE_VARIANTS`, chosen per dims by
        `WIDE_DEFAULTS`): the split ring, dO's stages fewer than Q's (do_smem has its own stage
        count and barriers), and DV_EARLY: dV issued once both P^T halves are in shared memory
        (a P-ready barrier), before dS^T is computed."""
        descs, smem, bars, seq, strides, ptrs, scales = args
        q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, p_smem, dq_smem = smem
        kv_bar, ready, empty, ds_ready, ready_do, empty_do, p_ready = bars
        z, h_kv, group, start_q, start_k, start_n, len_q, len_k, diag, m_lo, m_count, total = seq
        dq_desc = descs[4]
        stride_dqb, stride_dqh, stride_dqs = strides[5]
        stride_dkb, stride_dkh, stride_dks = strides[6]
        stride_dvb, stride_dvh, stride_dvs = strides[7]
        dk_ptr, dv_ptr = ptrs[2:]
        qk_scale, sm_scale = scales
        NUM_STAGES: gl.constexpr = q_smem.type.shape[0]
        DO_STAGES: gl.constexpr = do_smem.type.shape[0]
        SPLIT_RING: gl.constexpr = DO_STAGES != NUM_STAGES
        BLOCK_M: gl.constexpr = q_smem.type.shape[1]
        WIDTH: gl.constexpr = q_smem.type.shape[2]
        WIDTH_V: gl.constexpr = do_smem.type.shape[2]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        ROWS: gl.constexpr = BLOCK_M // 2  # query rows of this warpgroup's score products
        COLS: gl.constexpr = WIDTH // 2  # dK's (and dQ's) columns of this warpgroup
        COLS_V: gl.constexpr = WIDTH_V // 2  # dV's
        gl.static_assert(BLOCK_N == 64 and BLOCK_M == 64)
        gl.static_assert(WIDTH // 2 < HEAD_DIM and HEAD_DIM <= WIDTH)
        gl.static_assert(WIDTH_V // 2 < HEAD_DIM_V and HEAD_DIM_V <= WIDTH_V)
        gl.static_assert(dq_smem.type.shape[2] == COLS)
        dtype: gl.constexpr = q_smem.dtype
        q0: gl.constexpr = WG * ROWS

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
        )
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS, 16]
        )
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, COLS_V, 16]
        )
        zero_s = gl.zeros([BLOCK_N, ROWS], gl.float32, s_layout)
        zero_dq = gl.zeros([BLOCK_M, COLS], gl.float32, dk_layout)
        # This warpgroup's columns of dK and dV; those past the head dims are never stored.
        dk = gl.zeros([BLOCK_N, COLS], gl.float32, dk_layout)
        dv = gl.zeros([BLOCK_N, COLS_V], gl.float32, dv_layout)
        key_edge = start_n + BLOCK_N > len_k
        diag_rows = start_n + BLOCK_N - 1 - diag

        mbarrier.wait(kv_bar, 0)
        _zero_rows_from(k_smem.index(0), len_k - start_n, 16)
        _zero_rows_from(v_smem.index(0), len_k - start_n, 16)
        dq_wg = dq_smem.index(WG)
        for it in range(total):
            res = _opaque_zero(it)  # as in `_consumer`: no hoisted descriptors of K and V
            k_res = k_smem.index(res)
            v_res = v_smem.index(res)
            stage = it % NUM_STAGES
            g = it // m_count
            m0 = m_lo + (it - g * m_count) * BLOCK_M
            mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
            q_t = q_smem.index(stage)
            if SPLIT_RING:
                # S^T issued on Q alone; dO (with delta) may still be on its way.
                stage_do = it % DO_STAGES
                _zero_rows_from(q_t, len_q - m0, 16)
                s_tok = _product_over_dim(k_res, q_t.slice(q0, ROWS), zero_s, HEAD_DIM)
                mbarrier.wait(ready_do.index(stage_do), (it // DO_STAGES) & 1)
                do_t = do_smem.index(stage_do)
                _zero_rows_from(do_t, len_q - m0, 16)
                dp_tok = _product_over_dim(v_res, do_t.slice(q0, ROWS), zero_s, HEAD_DIM_V)
            else:
                stage_do = stage
                do_t = do_smem.index(stage)
                _zero_rows_from(q_t, len_q - m0, 16)
                _zero_rows_from(do_t, len_q - m0, 16)
                # S^T and dP^T of this warpgroup's 32 queries, over the dims' own columns.
                s_tok = _product_over_dim(k_res, q_t.slice(q0, ROWS), zero_s, HEAD_DIM)
                dp_tok = _product_over_dim(v_res, do_t.slice(q0, ROWS), zero_s, HEAD_DIM_V)
            buf = it % 2
            p_buf = p_smem.index(buf)  # [queries, keys]
            ds_buf = ds_smem.index(buf)
            masked = key_edge | (m0 + BLOCK_M > len_q) | (m0 < diag_rows)
            s_t = warpgroup_mma_wait(1, deps=[s_tok])
            lse_rows = lse_smem.index(stage).slice(q0, ROWS)
            p_t = _probs(s_t, lse_rows, qk_scale, masked, start_n, m0 + q0, len_q, len_k, diag)
            # P^T [keys, queries] into this warpgroup's query rows of the query-major tile.
            p_buf.slice(q0, ROWS).permute((1, 0)).store(p_t.to(dtype))
            if DV_EARLY:
                # dV as soon as both halves of P are written: it runs while dS^T is computed.
                # (Buffer reuse as for dS below: P-ready barriers of the next step order it.)
                fence_async_shared()
                _partition_barrier()
                mbarrier.arrive(p_ready.index(buf), count=1)
                mbarrier.wait(p_ready.index(buf), (it // 2) & 1)
                dv_tok = warpgroup_mma(
                    p_buf.permute((1, 0)), do_t.slice(WG * COLS_V, COLS_V, dim=1), dv,
                    is_async=True,
                )  # fmt: skip
                # Groups retire in issue order: one outstanding (dV) means dP^T landed.
                dp_t = warpgroup_mma_wait(1, deps=[dp_tok])
            else:
                dp_t = warpgroup_mma_wait(0, deps=[dp_tok])
            delta_rows = delta_smem.index(stage_do).slice(q0, ROWS)
            ds_t = _dscores(p_t, dp_t, delta_rows, masked, start_n, m0 + q0, len_q, len_k, diag)
            ds_buf.slice(q0, ROWS).permute((1, 0)).store(ds_t.to(dtype))
            # Both warpgroups' halves before any product reads the tiles (generic-proxy stores
            # read by wgmma: fence first). Buffer `buf` is written again two steps on, after
            # the next step's barrier, which the other warpgroup reaches only once its
            # products reading it here have landed.
            fence_async_shared()
            _partition_barrier()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)
            if not DV_EARLY:
                dv_tok = warpgroup_mma(
                    p_buf.permute((1, 0)), do_t.slice(WG * COLS_V, COLS_V, dim=1), dv,
                    is_async=True,
                )  # fmt: skip
            dk_tok = warpgroup_mma(
                ds_buf.permute((1, 0)), q_t.slice(WG * COLS, COLS, dim=1), dk, is_async=True
            )
            dq_tok = warpgroup_mma(
                ds_buf, k_res.slice(WG * COLS, COLS, dim=1), zero_dq, use_acc=False,
                is_async=True,
            )  # fmt: skip
            # Groups retire in issue order: one outstanding (dQ) means dV and dK landed, and
            # the stage's Q and dO go back to the producer while dQ runs.
            dv, dk = warpgroup_mma_wait(1, deps=[dv_tok, dk_tok])
            _release(empty.index(stage))
            if SPLIT_RING:
                mbarrier.arrive(empty_do.index(stage_do), count=1)  # after `_release`'s barrier
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
            # The accumulator is contiguous and W columns a head (`dq_accumulator`).
            dq_row = z * (stride_dqb // stride_dqs) + start_q + m0
            dq_col = (h_kv * group + g) * stride_dqh + WG * COLS
            tma.store_wait(0)  # the previous reduce has read `dq_wg`
            _partition_barrier()
            _reduce_dq(dq, dq_wg, dq_desc, dq_row, dq_col)
        tma.store_wait(0)

        # Epilogue: this warpgroup's columns of dK (times the softmax scale) and dV.
        z64 = z.to(gl.int64)
        out_r = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dk_layout))
        out_c = WG * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, dk_layout))
        k_mask = gl.expand_dims(out_r < len_k, 1) & gl.expand_dims(out_c < HEAD_DIM, 0)
        row_at = (start_k + out_r).to(gl.int64)
        dk_base = z64 * stride_dkb + h_kv.to(gl.int64) * stride_dkh
        dk_ptrs = dk_ptr + dk_base + gl.expand_dims(row_at * stride_dks, 1)
        gl.store(dk_ptrs + gl.expand_dims(out_c, 0), (dk * sm_scale).to(dtype), mask=k_mask)
        out_rv = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dv_layout))
        out_cv = WG * COLS_V + gl.arange(0, COLS_V, layout=gl.SliceLayout(0, dv_layout))
        v_mask = gl.expand_dims(out_rv < len_k, 1) & gl.expand_dims(out_cv < HEAD_DIM_V, 0)
        row_at_v = (start_k + out_rv).to(gl.int64)
        dv_base = z64 * stride_dvb + h_kv.to(gl.int64) * stride_dvh
        dv_ptrs = dv_ptr + dv_base + gl.expand_dims(row_at_v * stride_dvs, 1)
        gl.store(dv_ptrs + gl.expand_dims(out_cv, 0), dv.to(dtype), mask=v_mask)
