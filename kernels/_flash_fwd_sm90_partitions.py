"""The partitions of the sm_90 forward (`_flash_fwd_sm90`): the producer that streams Q, K and V
by TMA, the consumer warpgroups' products, online softmax and epilogue for one tile, their
ping-pong turns, and the persistent grid's tile scheduling (non-causal rounds, the causal
launches' tile counter). The design, the shapes and the tables that size these are in
`_flash_fwd_sm90`'s docstring.
"""

from __future__ import annotations

from ._common import LN2
from ._sm90_common import GLUON_AVAILABLE

WARPGROUP_ROWS = 64  # query rows per consumer warpgroup (a wgmma's M is 64 per warpgroup)

if GLUON_AVAILABLE:
    from ._sm90_common import (
        _interleaved_tile,
        _product_over_dim,
        _release,
        _seq_bounds,
        _tile_origin,
        _tma_load,
        _tma_store,
        _zero_rows_from,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    WG_ROWS = gl.constexpr(WARPGROUP_ROWS)

    @gluon.jit
    def _num_consumers(q_smem):
        """Consumer warpgroups of the program: one Q tile each."""
        return q_smem.type.shape[0]

    @gluon.jit
    def _producer(
        q_desc, k_desc, v_desc, o_desc, smem, bars, q_row, q_col, k_row, k_col, v_row, v_col,
        start_m, len_q, len_k, diag, num_blocks, first_masked, qk_scale,
        out_ptr, lse_ptr, o_base, lse_base, stride_os, stride_ls,
    ):  # fmt: skip
        """The producer warpgroup: each consumer's Q rows once, then K and V of key blocks
        0..num_blocks-1 into the stage ring, each stage reused once every consumer released it."""
        q_smem, k_smem, v_smem, _ = smem
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
        NUM_WG: gl.constexpr = q_smem.type.shape[0]
        q_bars, k_ready, k_empty, v_ready, v_empty, turn, q_empty = bars
        for wg in gl.static_range(NUM_WG):
            mbarrier.expect(q_bars.index(wg), q_desc.block_type.nbytes)
            _tma_load(q_desc, [q_row + wg * WG_ROWS, q_col], q_bars.index(wg), q_smem.index(wg))
        for it in range(num_blocks):
            stage = it % NUM_STAGES
            # Empty barriers start "completed" for parity 1: the first lap never waits.
            phase = ((it // NUM_STAGES) & 1) ^ 1
            row = it * BLOCK_N
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row + row, k_col], k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            _tma_load(v_desc, [v_row + row, v_col], v_ready.index(stage), v_smem.index(stage))

    @gluon.jit
    def _produce_tile(
        q_desc, k_desc, v_desc, smem, bars, q_row, q_col, k_row, k_col, v_row, v_col, num_blocks,
        ring_base, tile_count,
    ):  # fmt: skip
        """The persistent grid's producer, one tile: K and V of its key blocks into the stage
        ring from position `ring_base` on (the ring runs on across tiles), and each
        warpgroup's Q rows once that warpgroup has handed the Q buffer back (`q_empty`, its
        `tile_count`-th hand-over). The first K block goes before Q: it only waits for a free
        stage, so it is in flight while the consumers finish the previous tile."""
        q_smem, k_smem, v_smem, _ = smem
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
        NUM_WG: gl.constexpr = q_smem.type.shape[0]
        q_bars, k_ready, k_empty, v_ready, v_empty, turn, q_empty = bars
        for it in range(num_blocks):
            ring = ring_base + it
            stage = ring % NUM_STAGES
            phase = ((ring // NUM_STAGES) & 1) ^ 1  # the first lap never waits (see _producer)
            row = it * BLOCK_N
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row + row, k_col], k_ready.index(stage), k_smem.index(stage))
            if it == 0:
                for wg in gl.static_range(NUM_WG):
                    mbarrier.wait(q_empty.index(wg), (tile_count & 1) ^ 1)
                    mbarrier.expect(q_bars.index(wg), q_desc.block_type.nbytes)
                    _tma_load(
                        q_desc, [q_row + wg * WG_ROWS, q_col], q_bars.index(wg), q_smem.index(wg)
                    )
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            _tma_load(v_desc, [v_row + row, v_col], v_ready.index(stage), v_smem.index(stage))

    @gluon.jit
    def _take_turn(turn, wg: gl.constexpr, n):
        """Wait until it is this warpgroup's turn to issue products (its n-th issue, from 0).

        Ping-pong (FlashAttention-3's inter-warpgroup schedule): the warpgroups issue in a
        fixed round (0, 1, .., 0, 1, ..), so one warpgroup's softmax runs on the CUDA cores while
        the others' products run on the tensor cores. `turn[wg]` completes each time the
        warpgroup before it in the round hands over; warpgroup 0 goes first (its barrier starts
        completed for parity 1, as every fresh mbarrier does).
        """
        if wg == 0:
            mbarrier.wait(turn.index(wg), (n & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(wg), n & 1)

    @gluon.jit
    def _pass_turn(turn, wg: gl.constexpr):
        NUM_WG: gl.constexpr = turn.type.shape[0]
        mbarrier.arrive(turn.index((wg + 1) % NUM_WG), count=1)

    @gluon.jit
    def _masked_scores(s, start_n, offs_m, offs_n, len_k, diag):
        """Scores with keys past len_k or past each row's diagonal (`diag` = len_k for no mask,
        which no row reaches) set to -inf."""
        cols = gl.expand_dims(start_n + offs_n, 0)
        visible = (cols < len_k) & (cols <= gl.expand_dims(offs_m, 1) + diag)
        return gl.where(visible, s, float("-inf"))

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale):
        """Online-softmax update for one score tile (log2 units): (p, alpha, m_new, l_new).

        A row that has seen no visible key keeps max -inf; it is shifted by 0 instead, so
        exp2 gives p = 0 and alpha = 0 rather than NaN.
        """
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_new = gl.where(m_new == float("-inf"), 0.0, m_new)
        # exp2 with log2(e) folded into qk_scale: one FMA per score.
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _consumer(args, WG: gl.constexpr, O_TMA: gl.constexpr, D_QK: gl.constexpr,
                  D_V: gl.constexpr):  # fmt: skip
        """Consumer warpgroup WG's partition in the one-tile-per-program grid: `args` is the
        producer's argument list (a partition's constants must sit at the top of its own)."""
        _, _, _, o_desc, smem, bars, _, _, _, _, _, _, start_m, len_q, len_k, diag, num_blocks, \
            first_masked, qk_scale, out_ptr, lse_ptr, o_base, lse_base, stride_os, \
            stride_ls = args  # fmt: skip
        _consume_tile(
            smem, bars, start_m, len_q, len_k, diag, num_blocks, first_masked, qk_scale,
            o_desc, out_ptr, lse_ptr, o_base, lse_base, stride_os, stride_ls, WG, 0, 0, 0,
            False, O_TMA, D_QK, D_V,
        )  # fmt: skip
        if O_TMA:
            tma.store_wait(0)  # the shared memory of a pending store must outlive it

    @gluon.jit
    def _warpgroup_blocks(row0, len_q, len_k, diag, num_blocks, BLOCK_N: gl.constexpr):
        """How many of the tile's num_blocks key blocks hold a key that the warpgroup's rows
        row0.. (WG_ROWS of them) see, at least one.

        The tile's blocks are those its last rows see. Under a causal mask a warpgroup above
        the last sees up to one block fewer (192-row tiles, 128-key blocks);
        and rows past the sequence's end (the last tile of a length that is no multiple of the
        tile, computed but never stored) need none. `diag` as in `_masked_scores`: len_k without
        a mask, which no row reaches, so every block counts there unless the rows lie past
        len_q. The first block always runs: the products start on it (`_consume_tile`).
        """
        hi = gl.minimum(len_k, row0 + WG_ROWS + diag)
        blocks = gl.minimum(num_blocks, gl.maximum(gl.cdiv(gl.maximum(hi, 0), BLOCK_N), 1))
        if row0 >= len_q:
            blocks = 1
        return blocks

    @gluon.jit
    def _consume_tile(
        smem, bars, start_m, len_q, len_k, diag, num_blocks, first_masked, qk_scale,
        o_desc, out_ptr, lse_ptr, o_base, lse_base, stride_os, stride_ls, WG: gl.constexpr,
        ring_base, turn_base, tile_count, PERSISTENT: gl.constexpr, O_TMA: gl.constexpr,
        D_QK: gl.constexpr, D_V: gl.constexpr,
    ):  # fmt: skip
        """One warpgroup: the products, online softmax and epilogue of its WG_ROWS query rows of
        one tile.

        Worker partitions get their arguments as run-time values, so the tile sizes come from
        the shared-memory buffers' types and the causal mask from `diag` (see _masked_scores).
        `ring_base`: key blocks this warpgroup consumed in earlier tiles (the stage ring's
        position), `turn_base`: its ping-pong turns so far, `tile_count`: its earlier tiles
        (the Q barrier's phase); all 0 in the one-tile grid. PERSISTENT: hand the Q buffer back
        once the tile's last S = Q K^T product has landed, so the producer loads the next
        tile's Q while this one's last P V product and epilogue run. O_TMA: store the
        warpgroup's output rows by TMA from its `o_smem` buffer (`o_desc`, the out tensor's
        `tma_view` grid) where all of them lie inside the sequence; else, and for a block
        that reaches past len_q, masked stores from registers. D_QK, D_V: the head dims, at
        most the tiles' widths (powers of two, from the buffers' types); narrower ones take
        the scores over their own columns only (`_product_over_dim`), so what the tile holds
        past them (the next head's values, or TMA's zero fill) never enters S, and out's
        columns past D_V are computed but never stored.
        """
        q_smem, k_smem, v_smem, o_smem = smem
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        HEAD_DIM_V: gl.constexpr = v_smem.type.shape[2]
        NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
        q_bars, k_ready, k_empty, v_ready, v_empty, turn, q_empty = bars
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM_V, 16]
        )
        # P feeds the P V product from registers, in the layout wgmma's A operand wants.
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        q_tile = q_smem.index(WG)
        row0 = start_m + WG * WG_ROWS

        offs_m = row0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([WG_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([WG_ROWS, HEAD_DIM_V], gl.float32, o_layout)

        # Block 0: S alone (nothing to overlap it with yet).
        mbarrier.wait(q_bars.index(WG), tile_count & 1)
        first = ring_base % NUM_STAGES
        mbarrier.wait(k_ready.index(first), (ring_base // NUM_STAGES) & 1)
        _take_turn(turn, WG, turn_base)
        s_tok = _product_over_dim(q_tile, k_smem.index(first), zero_s, D_QK)
        _pass_turn(turn, WG)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        _release(k_empty.index(first))
        if first_masked == 0:
            s = _masked_scores(s, 0, offs_m, offs_n, len_k, diag)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        # Steady state: issue S(it) and O += P(it-1) V(it-1), take S(it)'s softmax, then rescale
        # O by the new max. The softmax does not overlap the P V product: ptxas schedules the
        # product's wait ahead of it (the SASS's wait sits before the first exponential).
        # Forcing the overlap (an mbarrier wait between the softmax and the product's wait,
        # which ptxas does not move the wait across) and cuDNN's order (one block at a time,
        # the turns around the exponentials) both measured slower without a mask
        # (docs/performance.md, "The forward's softmax and the P V product").
        NUM_WG: gl.constexpr = q_smem.type.shape[0]
        if NUM_WG > 2:
            wg_blocks = _warpgroup_blocks(row0, len_q, len_k, diag, num_blocks, BLOCK_N)
        else:
            # Two warpgroups (d = 128): a tile's rows span one key block, so a causal warpgroup
            # skips a block only off a 128-aligned diagonal or past a sequence's end; compiled
            # in, the skip made the d = 128 forward 2-3.5% slower (same process, s = 4k-16k).
            wg_blocks = num_blocks
        for it in range(1, wg_blocks):
            ring = ring_base + it  # this block's position in the stage ring, over all tiles
            stage = ring % NUM_STAGES
            prev = (ring - 1) % NUM_STAGES
            mbarrier.wait(k_ready.index(stage), (ring // NUM_STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((ring - 1) // NUM_STAGES) & 1)
            _take_turn(turn, WG, turn_base + it)
            s_tok = _product_over_dim(q_tile, k_smem.index(stage), zero_s, D_QK)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            _pass_turn(turn, WG)
            # wgmma groups retire in issue order: one outstanding (P V) means S(it) has landed.
            s = warpgroup_mma_wait(1, deps=[s_tok])
            _release(k_empty.index(stage))
            if it >= first_masked:
                s = _masked_scores(s, it * BLOCK_N, offs_m, offs_n, len_k, diag)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            # p_op travels through the wait so that LLVM keeps it until the product is done
            # (ptxas does not see these operands: they sit in the wait's comment).
            acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
            _release(v_empty.index(prev))
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            acc = acc * gl.expand_dims(alpha_o, 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)

        if PERSISTENT:
            # Every S product of the tile has landed (the loop waited for each): Q is free.
            _release(q_empty.index(WG))
        # The last P V product: of block wg_blocks - 1, the last one with a key these rows see.
        ring_pv = ring_base + wg_blocks - 1
        stage_pv = ring_pv % NUM_STAGES
        mbarrier.wait(v_ready.index(stage_pv), (ring_pv // NUM_STAGES) & 1)
        # Only the tile's last key block can reach past len_k: its V rows there are zeroed (a
        # no-op for an earlier block, which ends below len_k).
        _zero_rows_from(v_smem.index(stage_pv), len_k - (wg_blocks - 1) * BLOCK_N, BLOCK_N)
        _take_turn(turn, WG, turn_base + wg_blocks)
        o_tok = warpgroup_mma(p_op, v_smem.index(stage_pv), acc, is_async=True)
        _pass_turn(turn, WG)
        acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        if PERSISTENT or wg_blocks < num_blocks:
            # The ring goes on (into the skipped blocks, or the next tile): this stage must
            # come back to the producer. (Its rows past len_k were zeroed by generic stores,
            # fenced before the product.)
            _release(v_empty.index(stage_pv))
        # The tile's blocks past wg_blocks hold no key these rows see: their products would add
        # nothing. The warpgroup still takes and passes a turn for each (the round stays in
        # step) and releases each stage once its loads have landed (a release before that would
        # count towards the stage's previous use).
        for it in range(wg_blocks, num_blocks):
            ring = ring_base + it
            stage = ring % NUM_STAGES
            mbarrier.wait(k_ready.index(stage), (ring // NUM_STAGES) & 1)
            mbarrier.wait(v_ready.index(stage), (ring // NUM_STAGES) & 1)
            _take_turn(turn, WG, turn_base + it + 1)
            _pass_turn(turn, WG)
            _release(k_empty.index(stage))
            _release(v_empty.index(stage))

        # Epilogue: rows with no visible key have l = 0 and acc = 0: output 0, LSE -inf.
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        has_keys = l_o > 0.0
        l_safe = gl.where(has_keys, l_o, 1.0)
        inv_l = gl.where(has_keys, 1.0 / l_safe, 0.0)
        out = acc * gl.expand_dims(inv_l, 1)
        lse = gl.where(has_keys, (m_o + gl.log2(l_safe)) * LN2, float("-inf"))

        rows = row0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, o_layout))
        row_ok = rows < len_q
        # A block of rows reaching past len_q must not be stored whole: the rows after a
        # sequence's end are the next sequence's, or padding the launcher zero-filled. The TMA
        # branch is built only where the tile is as wide as v (constexpr): elsewhere o_smem is a
        # stand-in of another shape.
        if O_TMA and D_V == HEAD_DIM_V:
            if row0 + WG_ROWS <= len_q:
                # One TMA store per warpgroup from shared memory, in flight while the next
                # tile starts, instead of masked stores from registers at every tile boundary
                # (32 of 4 bytes a thread at d = 128; `_flash_fwd_sm90.TMA_EPILOGUE`).
                o_tile = o_smem.index(WG)
                tma.store_wait(0)  # the previous tile's store has read the buffer
                o_tile.store(out.to(dtype))
                fence_async_shared()  # generic-proxy writes, then the async-proxy read
                o_row = (o_base // stride_os).to(gl.int32) + row0
                o_col = (o_base % stride_os).to(gl.int32)
                _tma_store(o_desc, [o_row, o_col], o_tile)
            else:
                _store_rows(out, out_ptr, o_base, rows, row_ok, stride_os, D_V, o_layout)
        else:
            _store_rows(out, out_ptr, o_base, rows, row_ok, stride_os, D_V, o_layout)
        gl.store(lse_ptr + lse_base + rows.to(gl.int64) * stride_ls, lse, mask=row_ok)

    @gluon.jit
    def _store_rows(out, out_ptr, o_base, rows, row_ok, stride_os, D_V: gl.constexpr,
                    o_layout: gl.constexpr):  # fmt: skip
        """A warpgroup's output rows stored from registers: rows past len_q and columns past
        d_v (a tile wider than v's head dim) are never written."""
        cols = gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, o_layout))
        o_ptrs = out_ptr + o_base + gl.expand_dims(rows.to(gl.int64) * stride_os, 1)
        o_ptrs = o_ptrs + gl.expand_dims(cols, 0)
        o_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < D_V, 0)
        gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)

    @gluon.jit
    def _tile_work(
        tile, num_m, num_pairs, order_pairs,
        cu_q_ptr, offsets_q_ptr, seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr,
        strides, num_heads_q, group, full_len_q, full_len_k,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEQ_MODE_Q: gl.constexpr,
        SEQ_MODE_K: gl.constexpr, IS_CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    ):  # fmt: skip
        """What one tile (BLOCK_M query rows of one (sequence, query head)) computes:
        (start_m, len_q, len_k, diag, num_blocks, first_masked, TMA origins of q/k/v, o_base,
        lse_base); num_blocks = 0 when the tile has nothing to do (rows past its sequence's end,
        or no visible key: the launcher pre-filled out = 0, lse = -inf there).

        The kernel's arguments (`strides`: its runtime strides as one tuple), so every partition
        of the persistent grid derives the same tiles. Constexprs and absent (None) pointers are
        passed one by one: packed in a tuple, Triton 3.6 did not keep them constant (the compile
        failed on a None pointer).
        """
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, \
            stride_vb, stride_vs, stride_vh, stride_ob, stride_oh, stride_lb, stride_lh, \
            stride_ls, stride_os = strides  # fmt: skip
        # Query blocks vary fastest (neighbours share one head's K/V in L2); causal launches
        # start the last query blocks, which see the most keys, first.
        if IS_CAUSAL:
            bh, i = _interleaved_tile(tile, num_m, num_pairs, order_pairs)
            m_idx = num_m - 1 - i
        else:
            bh = tile // num_m
            m_idx = tile % num_m
        z = bh // num_heads_q
        h = bh % num_heads_q
        h_kv = h // group
        start_m = m_idx * BLOCK_M
        start_q, len_q = _seq_bounds(
            z, cu_q_ptr, offsets_q_ptr, seqlens_q_ptr, full_len_q, SEQ_MODE_Q
        )
        start_k, len_k = _seq_bounds(
            z, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, full_len_k, SEQ_MODE_K
        )
        diag = len_q * 0
        if BOTTOM_RIGHT:
            diag = len_k - len_q
        # Keys [0, hi) are visible to some row; blocks from `first_masked` on need the mask.
        # Every warpgroup takes a turn for each of the tile's blocks (the ping-pong needs equal
        # turns); the upper ones mask what their rows cannot see and, with three warpgroups,
        # skip the products of the blocks they see nothing of (`_warpgroup_blocks`).
        hi = len_k
        full = len_k
        if IS_CAUSAL:
            hi = gl.minimum(len_k, start_m + BLOCK_M + diag)
            full = gl.minimum(len_k, start_m + 1 + diag)
        num_blocks = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)
        if start_m >= len_q:
            num_blocks = 0
        first_masked = gl.maximum(full, 0) // BLOCK_N
        if not IS_CAUSAL:
            diag = len_k  # the consumers' causal test then passes every key below len_k

        q_row, q_col = _tile_origin(z, h, start_q + start_m, stride_qb, stride_qh, stride_qs)
        k_row, k_col = _tile_origin(z, h_kv, start_k, stride_kb, stride_kh, stride_ks)
        v_row, v_col = _tile_origin(z, h_kv, start_k, stride_vb, stride_vh, stride_vs)
        o_base = z.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
        o_base = o_base + start_q.to(gl.int64) * stride_os
        lse_base = z.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        lse_base = lse_base + start_q.to(gl.int64) * stride_ls
        origins = (q_row, q_col, k_row, k_col, v_row, v_col)
        return start_m, len_q, len_k, diag, num_blocks, first_masked, origins, o_base, lse_base

    @gluon.jit
    def _round_tile(r, first, step):
        """The tile that program `first` of `step` takes in round r of the persistent grid.
        Rounds alternate direction (a snake: 0..step-1, then back): where the launch order runs
        longest-first (causal), each program's tiles then add up to about the same work. A
        tile past the last (in the last round) is the caller's to skip."""
        return r * step + first + (r % 2) * (step - 1 - 2 * first)

    @gluon.jit
    def _publish_tile(sched, r, tile):
        """The producer hands round r's tile index to the consumers (dynamic scheduler): into
        slot r % 2 once every consumer has read what the slot held two rounds before."""
        slots, ready, empty = sched
        slot = r % 2
        mbarrier.wait(empty.index(slot), ((r // 2) & 1) ^ 1)  # fresh barriers: no wait
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        slots.index(slot).store(gl.full([1], tile, gl.int32, one))
        _release(ready.index(slot))  # every producer thread's store, then the arrive

    @gluon.jit
    def _receive_tile(sched, r):
        """A consumer warpgroup's round-r tile index from the producer (`_publish_tile`); the
        slot goes back once all four warps have read it."""
        slots, ready, empty = sched
        slot = r % 2
        mbarrier.wait(ready.index(slot), (r // 2) & 1)
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        tile = gl.max(slots.index(slot).load(one), axis=0)
        _release(empty.index(slot))
        return tile

    @gluon.jit
    def _persistent_producer(
        q_desc, k_desc, v_desc, o_desc, smem, bars, first, step, num_tiles, num_m, num_pairs,
        order_pairs, cu_q_ptr, offsets_q_ptr, seqlens_q_ptr, cu_k_ptr, offsets_k_ptr,
        seqlens_k_ptr, strides, num_heads_q, group, full_len_q, full_len_k, out_ptr, lse_ptr,
        qk_scale, sched, tile_counter, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL, BOTTOM_RIGHT, WG,
        DYNAMIC, O_TMA, D_QK, D_V,
    ):  # fmt: skip
        """The persistent grid's producer: this program's tile of every round (`_round_tile`),
        in order (the consumers walk the same list), or with DYNAMIC the tiles it takes from
        `tile_counter` (its first is its program index; each later one is `step` plus the
        counter's old value; the counter is back at 0 when the launch ends), handed to the
        consumers through `sched` (`_publish_tile`).
        o_desc, out_ptr, lse_ptr, qk_scale, WG, O_TMA, D_QK, D_V unused."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        BLOCK_M: gl.constexpr = smem[0].type.shape[0] * WG_ROWS
        ring_base = 0
        tile_count = 0
        if DYNAMIC:
            tile = first
            taken = first * 0 - 1  # the counter's last value this program took
            r = 0
            while tile < num_tiles:
                _publish_tile(sched, r, tile)
                work = _tile_work(
                    tile, num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr, seqlens_q_ptr,
                    cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides, num_heads_q, group,
                    full_len_q, full_len_k, BLOCK_M, BLOCK_N, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL,
                    BOTTOM_RIGHT,
                )  # fmt: skip
                num_blocks = work[4]
                if num_blocks > 0:
                    q_row, q_col, k_row, k_col, v_row, v_col = work[6]
                    _produce_tile(
                        q_desc, k_desc, v_desc, smem, bars, q_row, q_col, k_row, k_col, v_row,
                        v_col, num_blocks, ring_base, tile_count,
                    )  # fmt: skip
                    ring_base += num_blocks
                    tile_count += 1
                # The next tile is taken once this one's loads are all issued: the consumers
                # are then still on it (or the one before), so it is in hand when they finish.
                taken = gl.atomic_add(tile_counter, 1)
                tile = step + taken
                r += 1
            # Every program takes one index past the last tile, so the launch takes num_tiles
            # indices in all; whoever took the last one is the counter's last user and leaves
            # it at 0 for the next launch (`_flash_fwd_sm90.tile_counter`).
            if taken == num_tiles - 1:
                gl.atomic_xchg(tile_counter, 0)
            _publish_tile(sched, r, tile)  # past the last tile: the consumers stop
            return
        for r in range(0, gl.cdiv(num_tiles, step)):
            tile = _round_tile(r, first, step)
            work = _tile_work(
                gl.minimum(tile, num_tiles - 1), num_m, num_pairs, order_pairs, cu_q_ptr,
                offsets_q_ptr, seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                num_heads_q, group, full_len_q, full_len_k, BLOCK_M, BLOCK_N, SEQ_MODE_Q,
                SEQ_MODE_K, IS_CAUSAL, BOTTOM_RIGHT,
            )  # fmt: skip
            num_blocks = work[4]
            if tile >= num_tiles:
                num_blocks = 0
            if num_blocks > 0:
                q_row, q_col, k_row, k_col, v_row, v_col = work[6]
                _produce_tile(
                    q_desc, k_desc, v_desc, smem, bars, q_row, q_col, k_row, k_col, v_row, v_col,
                    num_blocks, ring_base, tile_count,
                )  # fmt: skip
                ring_base += num_blocks
                tile_count += 1

    @gluon.jit
    def _persistent_consumer(
        q_desc, k_desc, v_desc, o_desc, smem, bars, first, step, num_tiles, num_m, num_pairs,
        order_pairs, cu_q_ptr, offsets_q_ptr, seqlens_q_ptr, cu_k_ptr, offsets_k_ptr,
        seqlens_k_ptr, strides, num_heads_q, group, full_len_q, full_len_k, out_ptr, lse_ptr,
        qk_scale, sched, tile_counter, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL, BOTTOM_RIGHT, WG,
        DYNAMIC, O_TMA, D_QK, D_V,
    ):  # fmt: skip
        """Consumer warpgroup WG (a constexpr) of the persistent grid: the tiles the producer
        streams, in the same order (with DYNAMIC, as `_receive_tile` hands them over). Each
        tile takes num_blocks + 1 ping-pong turns, so the turn count so far is the ring
        position plus the tiles done; tile_counter unused."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        BLOCK_M: gl.constexpr = smem[0].type.shape[0] * WG_ROWS
        stride_ls = strides[13]
        stride_os = strides[14]
        ring_base = 0
        tile_count = 0
        if DYNAMIC:
            r = 0
            tile = _receive_tile(sched, r)
            while tile < num_tiles:
                start_m, len_q, len_k, diag, num_blocks, first_masked, _, o_base, lse_base = (
                    _tile_work(
                        tile, num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr,
                        seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                        num_heads_q, group, full_len_q, full_len_k, BLOCK_M, BLOCK_N,
                        SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL, BOTTOM_RIGHT,
                    )
                )  # fmt: skip
                if num_blocks > 0:
                    _consume_tile(
                        smem, bars, start_m, len_q, len_k, diag, num_blocks, first_masked,
                        qk_scale, o_desc, out_ptr, lse_ptr, o_base, lse_base, stride_os,
                        stride_ls, WG, ring_base, ring_base + tile_count, tile_count, True,
                        O_TMA, D_QK, D_V,
                    )  # fmt: skip
                    ring_base += num_blocks
                    tile_count += 1
                r += 1
                tile = _receive_tile(sched, r)
            if O_TMA:
                tma.store_wait(0)  # the shared memory of a pending store must outlive it
            return
        for r in range(0, gl.cdiv(num_tiles, step)):
            tile = _round_tile(r, first, step)
            start_m, len_q, len_k, diag, num_blocks, first_masked, _, o_base, lse_base = (
                _tile_work(
                    gl.minimum(tile, num_tiles - 1), num_m, num_pairs, order_pairs, cu_q_ptr,
                    offsets_q_ptr, seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr,
                    strides, num_heads_q, group, full_len_q, full_len_k, BLOCK_M, BLOCK_N,
                    SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL, BOTTOM_RIGHT,
                )
            )  # fmt: skip
            if tile >= num_tiles:
                num_blocks = 0
            if num_blocks > 0:
                _consume_tile(
                    smem, bars, start_m, len_q, len_k, diag, num_blocks, first_masked, qk_scale,
                    o_desc, out_ptr, lse_ptr, o_base, lse_base, stride_os, stride_ls, WG,
                    ring_base, ring_base + tile_count, tile_count, True, O_TMA, D_QK, D_V,
                )  # fmt: skip
                ring_base += num_blocks
                tile_count += 1
        if O_TMA:
            tma.store_wait(0)  # the shared memory of a pending store must outlive it
