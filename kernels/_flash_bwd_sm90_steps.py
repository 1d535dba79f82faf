"""The steps of the sm_90 backward's consumer warpgroups (`_flash_bwd_sm90`): the key-major
products over the head dim's own columns, the probabilities and score gradients of a key-major
tile, the masks of its invisible pairs, the 128-query step's halves, the zeroing of rows past a
sequence's end and the dQ share's TMA reduce-add. Shapes and the schedule are in
`_flash_bwd_sm90`'s docstring.
"""

from __future__ import annotations

from ._common import LOG2E
from ._sm90_common import GLUON_AVAILABLE

if GLUON_AVAILABLE:
    from ._sm90_common import (
        _partition_barrier,
        fence_async_shared,
        gl,
        gluon,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # A TMA reduce-add of a shared-memory tile into global memory: `tma.async_atomic_add` in
    # later Triton versions; Triton 3.6's Gluon builds the operation but has no Python name for it.
    _tma_reduce_add = getattr(tma, "async_atomic_add", None)
    if _tma_reduce_add is None:
        from triton._C.libtriton import ir
        from triton.experimental.gluon.language._core import builtin

        @builtin
        def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(
                ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
            )

    @gluon.jit
    def _opaque_zero(x):
        """0, computed at run time from x (inline asm the compiler cannot look through)."""
        return gl.inline_asm_elementwise(
            "mov.b32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _visible_keys(p_t, key0, m0, len_q, len_k, diag):
        """P^T (or dS^T) [keys from key0, queries from m0] with invisible pairs set to 0: keys
        past len_k, queries past len_q, and keys past each query's diagonal (`diag` = len_k
        without a mask). A select, not a -inf score: garbage scores or deltas of out-of-range
        rows never reach the sums."""
        layout: gl.constexpr = p_t.type.layout
        keys = key0 + gl.arange(0, p_t.type.shape[0], layout=gl.SliceLayout(1, layout))
        rows = m0 + gl.arange(0, p_t.type.shape[1], layout=gl.SliceLayout(0, layout))
        k2 = gl.expand_dims(keys, 1)
        q2 = gl.expand_dims(rows, 0)
        visible = (k2 < len_k) & (q2 < len_q) & (k2 <= q2 + diag)
        return gl.where(visible, p_t, 0.0)

    @gluon.jit
    def _reduce_dq(dq, staging, dq_desc, row, col):
        """Add a [64, 64] fp32 dQ share into the accumulator at TMA (row, col) of `dq_desc`'s
        grid, through this warpgroup's `staging` tile and one TMA reduce-add (FlashAttention-3's
        bulk reduction): the consumers issue no atomics, and the L2 sees whole 128-byte lines.

        Other key blocks' programs add to the same elements; each element's add is atomic.
        Rows of the box past the step's last query hold exact zeros (dS^T is 0 there and K is
        finite), so adding them into the next sequence's or the padding's rows changes nothing.
        The caller waits for the copy's shared-memory read (`tma.store_wait`) before the next
        store into `staging`.
        """
        staging.store(dq)
        fence_async_shared()  # generic-proxy stores, read by the TMA (async proxy)
        _partition_barrier()
        _tma_reduce_add(dq_desc, [row, col], staging)

    @gluon.jit
    def _owns_dq(step, WG: gl.constexpr, ALTERNATE: gl.constexpr):
        """Whether warpgroup WG computes step `step`'s dQ share (d = 64: every other step)."""
        if ALTERNATE:
            return step % 2 == WG
        else:
            return step >= 0

    @gluon.jit
    def _wait_dv(pending: gl.constexpr, dv_tok, other_tok, p_ops, P_IN_REGS: gl.constexpr):
        """(dV, the other product) once at most `pending` wgmma groups are outstanding; with
        P_IN_REGS the registers of P^T, dV's A operand (`p_ops`: one tile, or the two halves
        of a 128-row step), stay live until then."""
        if P_IN_REGS:
            p_a, p_b = p_ops
            if p_b is None:
                dv, other, p_a = warpgroup_mma_wait(pending, deps=[dv_tok, other_tok, p_a])
            else:
                dv, other, p_a, p_b = warpgroup_mma_wait(
                    pending, deps=[dv_tok, other_tok, p_a, p_b]
                )
        else:
            dv, other = warpgroup_mma_wait(pending, deps=[dv_tok, other_tok])
        return dv, other

    @gluon.jit
    def _probs(s_t, lse_rows, qk_scale, masked, key0, m0, len_q, len_k, diag):
        """P^T = exp2(S^T * scale * log2e - LSE * log2e) of [keys from key0, queries from m0],
        invisible pairs 0. Rows that saw no key carry LSE -inf; their P is masked to 0, and
        any finite stand-in keeps exp2 from producing NaN first."""
        lse = lse_rows.load(gl.SliceLayout(0, s_t.type.layout))
        lse2 = gl.where(lse == float("-inf"), 0.0, lse) * LOG2E
        # exp2 with log2(e) folded into qk_scale and the LSE: one FMA per score.
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
        if masked:
            p_t = _visible_keys(p_t, key0, m0, len_q, len_k, diag)
        return p_t

    @gluon.jit
    def _dscores(p_t, dp_t, delta_rows, masked, key0, m0, len_q, len_k, diag):
        """dS^T = P^T (dP^T - delta), invisible pairs 0 (delta past a sequence's end may be
        anything, never written: 0 x NaN)."""
        delta = delta_rows.load(gl.SliceLayout(0, dp_t.type.layout))
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        if masked:
            ds_t = _visible_keys(ds_t, key0, m0, len_q, len_k, diag)
        return ds_t

    @gluon.jit
    def _scores_by_halves(
        k_wg, v_wg, q_t, do_t, p_wg, ds_wg, rows, dv, qk_scale, masked, bounds,
        WAIT_LATE: gl.constexpr, P_IN_REGS: gl.constexpr,
    ):  # fmt: skip
        """A 128-query step's S^T, dP^T, P^T and dS^T for one warpgroup's 64 keys, as two
        [64 keys, 64 queries] halves; P^T and dS^T go into `p_wg` and `ds_wg` (each
        [64 keys, 128 queries]), and dV += P^T dO is issued per half. Returns the dV token
        (pending); with P_IN_REGS (P^T from registers, `P_FROM_REGISTERS`) also the second
        half's P^T operand, which must stay live until dV lands (the first half's is released
        at the wait that sees its product land); the caller fences and orders the dS^T stores,
        then issues dK += dS^T Q over all 128 queries.

        Registers (240 a thread): dK and dV take 2 x 32; each half's S^T and dP^T 2 x 32, and
        its LSE and delta vectors 16 each, loaded where used. Only one half's tiles are live at
        a time, so the peak is the 64-row step's. Offline compiles (Triton 3.6) of the
        alternatives: one [64, 128] S^T and dP^T per step (2 x 64 registers, 32-register
        vectors) spilled 148-456 bytes; both halves' products issued up front, 4-140 bytes.
        """
        lse_rows, delta_rows = rows
        key0, m0, len_q, len_k, diag = bounds
        dtype: gl.constexpr = q_t.dtype
        HALF: gl.constexpr = q_t.type.shape[0] // 2
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
        )
        KEYS: gl.constexpr = k_wg.type.shape[0]
        zero = gl.zeros([KEYS, HALF], gl.float32, layout)
        p_op_layout: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=dv.type.layout, k_width=2
        )
        q_a = q_t.slice(0, HALF).permute((1, 0))
        q_b = q_t.slice(HALF, HALF).permute((1, 0))
        do_a = do_t.slice(0, HALF).permute((1, 0))
        do_b = do_t.slice(HALF, HALF).permute((1, 0))
        # The halves one after the other, each as the 64-row step's schedule (S^T and dP^T
        # issued; P^T while dP^T runs; dS^T while dV runs): at most one half's S^T and dP^T
        # are live, so the peak is the 64-row step's (2 x 32 + dK and dV).
        s_a_tok = warpgroup_mma(k_wg, q_a, zero, use_acc=False, is_async=True)
        dp_a_tok = warpgroup_mma(v_wg, do_a, zero, use_acc=False, is_async=True)
        if not WAIT_LATE:
            # The previous step's dQ reduce has read the staging tile before it is stored into
            # again (at this step's end, after the P^T barrier below orders every thread after
            # this).
            tma.store_wait(0)
        # wgmma groups retire in issue order: N outstanding means all but the last N landed.
        s_a = warpgroup_mma_wait(1, deps=[s_a_tok])
        p_a = _probs(s_a, lse_rows.slice(0, HALF), qk_scale, masked, key0, m0, len_q, len_k, diag)
        if P_IN_REGS:
            p_a_op = gl.convert_layout(p_a.to(dtype), p_op_layout)
            dv_tok = warpgroup_mma(p_a_op, do_t.slice(0, HALF), dv, is_async=True)
        else:
            p_wg.slice(0, HALF, dim=1).store(p_a.to(dtype))
            fence_async_shared()
            _partition_barrier()
            dv_tok = warpgroup_mma(
                p_wg.slice(0, HALF, dim=1), do_t.slice(0, HALF), dv, is_async=True
            )
        dp_a = warpgroup_mma_wait(1, deps=[dp_a_tok])
        ds_a = _dscores(p_a, dp_a, delta_rows.slice(0, HALF), masked, key0, m0, len_q, len_k, diag)
        # dS^T into this warpgroup's rows of the shared tile (the caller fences and waits).
        ds_wg.slice(0, HALF, dim=1).store(ds_a.to(dtype))
        s_b_tok = warpgroup_mma(k_wg, q_b, zero, use_acc=False, is_async=True)
        dp_b_tok = warpgroup_mma(v_wg, do_b, zero, use_acc=False, is_async=True)
        if P_IN_REGS:
            # One outstanding (dP^T of this half): the first half's dV has landed too.
            s_b, p_a_op = warpgroup_mma_wait(1, deps=[s_b_tok, p_a_op])
        else:
            s_b = warpgroup_mma_wait(1, deps=[s_b_tok])
        p_b = _probs(
            s_b, lse_rows.slice(HALF, HALF), qk_scale, masked, key0, m0 + HALF, len_q, len_k,
            diag,
        )  # fmt: skip
        if P_IN_REGS:
            p_b_op = gl.convert_layout(p_b.to(dtype), p_op_layout)
            dv_tok = warpgroup_mma(p_b_op, do_t.slice(HALF, HALF), dv_tok, is_async=True)
        else:
            p_wg.slice(HALF, HALF, dim=1).store(p_b.to(dtype))
            fence_async_shared()
            _partition_barrier()
            dv_tok = warpgroup_mma(
                p_wg.slice(HALF, HALF, dim=1), do_t.slice(HALF, HALF), dv_tok, is_async=True
            )
        dp_b = warpgroup_mma_wait(1, deps=[dp_b_tok])
        ds_b = _dscores(
            p_b, dp_b, delta_rows.slice(HALF, HALF), masked, key0, m0 + HALF, len_q, len_k,
            diag,
        )  # fmt: skip
        ds_wg.slice(HALF, HALF, dim=1).store(ds_b.to(dtype))
        if P_IN_REGS:
            pending = (dv_tok, p_b_op)
        else:
            pending = dv_tok
        return pending
