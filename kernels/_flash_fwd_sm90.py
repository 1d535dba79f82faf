"""Flash-attention forward for Hopper (sm_90), written in Gluon: TMA, wgmma, mbarriers and warp
specialization driven explicitly.

Shapes (docs/internals.md), as for the portable kernel in `_flash_fwd.py`:
    dense  q [b, s_q, h_q, d], k [b, s_k, h_kv, d], v [b, s_k, h_kv, d]
           -> out [b, s_q, h_q, d], lse [b, h_q, s_q]
    varlen q [t_q, h_q, d], k [t_k, h_kv, d], v [t_k, h_kv, d] -> out [t_q, h_q, d], lse [h_q, t_q]

A tile is BLOCK_M = 64 x `CONSUMERS[d]` query rows of one (sequence, query head) (128 at
d = 128 and 256, 192 at d = 64). Launches run one program per SM (`PERSISTENT`; `PERSISTENT_CAUSAL`
for causal ones), its producer streaming the next tile's K, V and Q while the consumers finish
the previous tile (the stage ring and the ping-pong turns run on across tiles; each consumer
warpgroup hands its Q buffer back once its last S product of a tile has landed). Non-causal
programs take one tile per round of the launch order (rounds alternate direction,
`_round_tile`). Causal tiles differ in length, so causal programs take theirs from a counter in
the launch order (longest first) as they free up: the producer takes the next tile with an
atomic add and hands its index to the consumers through shared memory
(`_publish_tile`, `_receive_tile`). A program's work is split over partitions
(`gl.warp_specialize`), FlashAttention-3's design:
- a producer warpgroup streams each consumer's Q rows once a tile and the K and V tiles of every
  visible key block by TMA into a NUM_STAGES-deep shared-memory ring, each stage guarded by a
  "ready" mbarrier (the TMA's transaction count) and an "empty" one (every consumer's release);
  it keeps 24 registers a thread and leaves the rest to the consumers (`setmaxnreg`);
- two or three consumer warpgroups of 64 rows each run the products on asynchronous wgmma and
  the online softmax. A warpgroup issues the next block's S = Q K^T and the previous block's
  O += P V together; the softmax then waits for both (ptxas schedules the P V product's wait
  ahead of the softmax: docs/performance.md, "The forward's softmax and the P V product").
  Between the warpgroups one mbarrier each makes them take turns issuing products (ping-pong,
  round-robin with three), so one warpgroup's softmax runs on the CUDA cores while the others'
  products run on the tensor cores.
- each consumer warpgroup writes its 64 output rows into its own shared-memory buffer and
  stores them with one TMA store, which runs on while the next tile starts (`TMA_EPILOGUE`);
  a block of rows that reaches past its sequence's end takes masked stores from registers.

How a tile is addressed: every operand is read through one 2-D TMA descriptor over its storage,
rows of `stride_s` elements (`tma_view`). Head h of sequence z starts at element
`z * stride_b + h * stride_h`, i.e. at row `(that) // stride_s`, column `(that) % stride_s`, so
bshd, sbhd, thd and the packed QKV views (sb3hd, bshd_bs2hd, ...) all take the same path without
a copy, as long as one head's row never wraps past a storage row (`tma_view` checks). Key rows past
a sequence's end read whatever follows it (the next sequence, padding, or TMA's zero fill past
the last row): their scores are masked and the last block's V rows zeroed (`_zero_rows_from`).
Query rows past the end are computed but never stored.

Covered: fp16/bf16, (d_qk, d_v) in `SUPPORTED_DIMS` (64, 80, 96, 128, 160, 192 and 256, and
(192, 128); dims between tile widths run on the next width up, `widths`), MHA/GQA/MQA, no mask /
causal (top-left or bottom-right), dense, right-padded (seqlens) and varlen (cu_seqlens,
seq_offsets). Everything else takes the portable kernel (`dispatch.sm90_forward_plan`).

Precision: as the portable kernel. Scores, softmax statistics and the accumulator are fp32; P is
rounded to the input dtype for the P V product; LSE is in natural log.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _common
from ._common import (
    LOG2E,
    causal_order_heads,
    cdiv,
    head_row_bytes,
    lse_strides,
    multiprocessors,
    planned,
    strides4,
)
from ._flash_fwd_sm90_partitions import WARPGROUP_ROWS
from ._launch import _current_stream, launch, launch_bound
from ._sm90_common import (
    GLUON_AVAILABLE,
    descriptor_maker,
    launch_binding,
    tile_width,
    tma_view,
)

if GLUON_AVAILABLE:
    from ._flash_fwd_sm90_partitions import (
        WG_ROWS,
        _consumer,
        _persistent_consumer,
        _persistent_producer,
        _producer,
        _tile_work,
    )
    from ._sm90_common import (
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
    )

CONSUMER_WARPS = 4  # the default partition: consumer warpgroup 0; the others are workers
# (BLOCK_N, NUM_STAGES) per head dim. Shared memory: Q BLOCK_M x d, NUM_STAGES K and V tiles and,
# with the TMA store (`TMA_EPILOGUE`), the output's staging, BLOCK_M x d (192 KiB at d = 128, 144
# KiB at d = 64). A third stage at d = 128 (224 KiB, without the staging) measured no faster
# (docs/performance.md, "The forward's softmax and the P V product"). d = 256: 64-key blocks, so
# that S, P and the 64 x 256 fp32 accumulator (128 registers a thread) fit a consumer's 240; Q
# and two stages take 192 KiB, which leaves no room for the output's staging.
TILES = {64: (128, 3), 128: (128, 2), 256: (64, 2)}
# The tables here are per tile width: the power of two a head dim's tiles are as wide as
# (`widths`). Head dims between widths run on the next one up: their scores take their own
# columns only (two products when the dim is no power of two, `_product_over_dim`), their V
# tile's extra columns give output columns that are never stored, so the tile's width costs
# shared memory, TMA bandwidth and P V work, not correctness. Covered: (d_qk, d_v) pairs.
SUPPORTED_DIMS = (
    (64, 64), (80, 80), (96, 96), (128, 128), (160, 160), (192, 192), (256, 256), (192, 128),
)  # fmt: skip
# Consumer warpgroups per head dim, so BLOCK_M = 64 x this. d = 128: two (FlashAttention-3's
# ping-pong). d = 64: three, FlashAttention-3's d = 64 tile: its products are short, so a
# softmax hides only under two other warpgroups' products.
CONSUMERS = {64: 3, 128: 2, 256: 2}
# Registers a thread, per consumer count: (at launch, [each worker consumer, the producer]).
# All warpgroups start with 65536 / threads (capped at 168 by the two-consumer design); the
# producer drops to 24 (the minimum) and the consumers share the rest, the default partition
# taking what the workers leave: two consumers 3 x 168 - 240 - 24 = 240 each; three consumers
# 4 x 128 - 2 x 160 - 24 = 168 for the default, 160 for the workers.
REGISTERS = {2: (168, [240, 24]), 3: (128, [160, 160, 24])}
# Per head dim: non-causal launches run a persistent grid (one program per SM walking the tiles,
# so the producer streams the next tile's K, V and Q under the previous tile's last products and
# epilogue). On the H100, best of three same-process rounds against one tile per program: d=128
# 1.02-1.06x at s = 1k-16k, d=64 1.01-1.09x (docs/performance.md, "A persistent grid for the
# sm_90 forward").
PERSISTENT = {64: True, 128: True, 256: True}
# The same for causal launches, whose tiles differ in length: their programs take each next tile
# from a counter (a dynamic scheduler), so an SM that finishes early starts another at once. A
# fixed deal of the tiles (a snake) ran the d=128 causal forward at 0.72x one program per tile;
# the counter runs d=128 and d=64 at 1.03-1.04x (s = 4k and 16k, H100, medians of five
# same-process rounds; docs/performance.md, "A dynamic tile scheduler").
PERSISTENT_CAUSAL = {64: True, 128: True, 256: True}
# Per head dim: each consumer warpgroup stores its output rows by TMA from shared memory
# (rows that reach past a sequence's end keep the masked stores from registers). On the H100,
# medians of five same-process rounds against the stores from registers: d=128 +9% / +17% at
# s = 1k (no mask / causal), +2% / +4% at 4k, level at 16k; d=64 +2-5%, level at 1k without a
# mask and at 4k causal (docs/performance.md, "The forward's output by TMA store").
TMA_EPILOGUE = {64: True, 128: True, 256: False}


def widths(d_qk: int, d_v: int) -> tuple[int, int]:
    """(q and k's tile width, v's) for a pair in `SUPPORTED_DIMS` (`tile_width`)."""
    return tile_width(d_qk), tile_width(d_v)


if GLUON_AVAILABLE:

    @gluon.jit
    def _attn_fwd_sm90(
        q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr,
        cu_q_ptr, offsets_q_ptr, seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
        stride_lb, stride_lh, stride_ls,
        num_heads_q, group, full_len_q, full_len_k, qk_scale, order_pairs, num_pairs, tile_counter,
        HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, SEQ_MODE_Q: gl.constexpr, SEQ_MODE_K: gl.constexpr,
        IS_CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr, O_TMA: gl.constexpr,
    ):  # fmt: skip
        """BLOCK_M query rows of one (sequence, query head) per tile, 64 per consumer warpgroup;
        num_pairs: sequences x query heads; CONSUMER_REGS: registers of each worker consumer
        (`REGISTERS`); order_pairs: the causal launch order's interleave (`_interleaved_tile`);
        tile_counter: a zeroed int32 the DYNAMIC persistent grid takes its tiles from and
        leaves at 0 (`tile_counter`; else None); o_desc: out's TMA grid (`tma_view`), which
        O_TMA stores each warpgroup's rows through (`TMA_EPILOGUE`).
        HEAD_DIM, HEAD_DIM_V: the head dims of q/k and of v; the tiles are as wide as the
        descriptors' boxes (`widths`).

        One tile per program, or with PERSISTENT a program per SM taking one tile per round of
        the launch order (`_round_tile`): the producer streams the next tile's K, V and Q while
        the consumers finish the previous tile's products and epilogue.
        """
        num_m = gl.cdiv(full_len_q, BLOCK_M)
        strides = (
            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, stride_ob, stride_oh, stride_lb, stride_lh,
            stride_ls, stride_os,
        )  # fmt: skip
        if not PERSISTENT:
            start_m, len_q, len_k, diag, num_blocks, first_masked, origins, o_base, lse_base = (
                _tile_work(
                    gl.program_id(0), num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr,
                    seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                    num_heads_q, group, full_len_q, full_len_k, BLOCK_M, BLOCK_N, SEQ_MODE_Q,
                    SEQ_MODE_K, IS_CAUSAL, BOTTOM_RIGHT,
                )
            )  # fmt: skip
            if num_blocks == 0:
                return

        dtype: gl.constexpr = q_desc.dtype
        NUM_WG: gl.constexpr = BLOCK_M // WG_ROWS
        QK_WIDTH: gl.constexpr = k_desc.block_type.shape[1]
        V_WIDTH: gl.constexpr = v_desc.block_type.shape[1]
        q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, WG_ROWS, QK_WIDTH], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, QK_WIDTH], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, V_WIDTH], v_desc.layout)
        if O_TMA:
            # Each consumer warpgroup's output rows on their way to the TMA store.
            o_smem = gl.allocate_shared_memory(dtype, [NUM_WG, WG_ROWS, V_WIDTH], o_desc.layout)
        else:
            o_smem = q_smem  # a stand-in, never touched: the rows go out from registers
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_bars = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], bar_layout)
        q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], bar_layout)
        turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], bar_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        for i in gl.static_range(NUM_WG):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)  # the persistent grid's Q hand-back
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            # A stage is free again once every consumer warpgroup has released it.
            mbarrier.init(k_empty.index(i), count=NUM_WG)
            mbarrier.init(v_empty.index(i), count=NUM_WG)
        fence_async_shared()
        smem = (q_smem, k_smem, v_smem, o_smem)
        bars = (q_bars, k_ready, k_empty, v_ready, v_empty, turn, q_empty)

        # The worker consumers, and the producer as a whole warpgroup. Registers move per
        # warpgroup: with a one-warp producer the compiler budgeted the default partition as if
        # the producer's three idle warps held none, and left it at 256 (256 + 240 + 24 > the
        # 3 x 168 a thread of each warpgroup has at launch: `setmaxnreg.inc` could wait
        # forever). With four warps the budget is exact (`REGISTERS`).
        if PERSISTENT:
            # These partitions take constexprs and absent (None) pointers, which must sit at the
            # top of a partition's argument list to stay constant: so each list is spelled out,
            # where the one-tile grid's consumers take (producer's arguments, warpgroup index).
            first, step, num_tiles = gl.program_id(0), gl.num_programs(0), num_m * num_pairs
            # The dynamic scheduler's two tile-index slots and their barriers (`_publish_tile`).
            slot_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            tile_slots = gl.allocate_shared_memory(gl.int32, [2, 1], slot_layout)
            tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
            tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
            for i in gl.static_range(2):
                mbarrier.init(tile_ready.index(i), count=1)
                mbarrier.init(tile_empty.index(i), count=NUM_WG)
            fence_async_shared()
            sched = (tile_slots, tile_ready, tile_empty)
            if NUM_WG == 2:
                gl.warp_specialize(
                    [
                        (_persistent_consumer, (
                            q_desc, k_desc, v_desc, o_desc, smem, bars, first, step,
                            num_tiles, num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr,
                            seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                            num_heads_q, group, full_len_q, full_len_k, out_ptr, lse_ptr,
                            qk_scale, sched, tile_counter, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL,
                            BOTTOM_RIGHT, 0, DYNAMIC, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                        (_persistent_consumer, (
                            q_desc, k_desc, v_desc, o_desc, smem, bars, first, step,
                            num_tiles, num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr,
                            seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                            num_heads_q, group, full_len_q, full_len_k, out_ptr, lse_ptr,
                            qk_scale, sched, tile_counter, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL,
                            BOTTOM_RIGHT, 1, DYNAMIC, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                        (_persistent_producer, (
                            q_desc, k_desc, v_desc, o_desc, smem, bars, first, step,
                            num_tiles, num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr,
                            seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                            num_heads_q, group, full_len_q, full_len_k, out_ptr, lse_ptr,
                            qk_scale, sched, tile_counter, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL,
                            BOTTOM_RIGHT, 0, DYNAMIC, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                    ],
                    [4, 4],
                    [CONSUMER_REGS, 24],
                )  # fmt: skip
            else:
                gl.warp_specialize(
                    [
                        (_persistent_consumer, (
                            q_desc, k_desc, v_desc, o_desc, smem, bars, first, step,
                            num_tiles, num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr,
                            seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                            num_heads_q, group, full_len_q, full_len_k, out_ptr, lse_ptr,
                            qk_scale, sched, tile_counter, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL,
                            BOTTOM_RIGHT, 0, DYNAMIC, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                        (_persistent_consumer, (
                            q_desc, k_desc, v_desc, o_desc, smem, bars, first, step,
                            num_tiles, num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr,
                            seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                            num_heads_q, group, full_len_q, full_len_k, out_ptr, lse_ptr,
                            qk_scale, sched, tile_counter, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL,
                            BOTTOM_RIGHT, 1, DYNAMIC, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                        (_persistent_consumer, (
                            q_desc, k_desc, v_desc, o_desc, smem, bars, first, step,
                            num_tiles, num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr,
                            seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                            num_heads_q, group, full_len_q, full_len_k, out_ptr, lse_ptr,
                            qk_scale, sched, tile_counter, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL,
                            BOTTOM_RIGHT, 2, DYNAMIC, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                        (_persistent_producer, (
                            q_desc, k_desc, v_desc, o_desc, smem, bars, first, step,
                            num_tiles, num_m, num_pairs, order_pairs, cu_q_ptr, offsets_q_ptr,
                            seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, strides,
                            num_heads_q, group, full_len_q, full_len_k, out_ptr, lse_ptr,
                            qk_scale, sched, tile_counter, SEQ_MODE_Q, SEQ_MODE_K, IS_CAUSAL,
                            BOTTOM_RIGHT, 0, DYNAMIC, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                    ],
                    [4, 4, 4],
                    [CONSUMER_REGS, CONSUMER_REGS, 24],
                )  # fmt: skip
        else:
            q_row, q_col, k_row, k_col, v_row, v_col = origins
            args = (
                q_desc, k_desc, v_desc, o_desc, smem, bars,
                q_row, q_col, k_row, k_col, v_row, v_col,
                start_m, len_q, len_k, diag, num_blocks, first_masked, qk_scale,
                out_ptr, lse_ptr, o_base, lse_base, stride_os, stride_ls,
            )  # fmt: skip
            if NUM_WG == 2:
                gl.warp_specialize(
                    [
                        (_consumer, (args, 0, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                        (_consumer, (args, 1, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                        (_producer, args),
                    ],
                    [4, 4],
                    [CONSUMER_REGS, 24],
                )
            else:
                gl.warp_specialize(
                    [(_consumer, (args, 0, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                     (_consumer, (args, 1, O_TMA, HEAD_DIM, HEAD_DIM_V)),
                     (_consumer, (args, 2, O_TMA, HEAD_DIM, HEAD_DIM_V)), (_producer, args)],
                    [4, 4, 4],
                    [CONSUMER_REGS, CONSUMER_REGS, 24],
                )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


def plan_views(q, k, v, varlen: bool):
    """The TMA grids of q, k and v, or None when any of them cannot take this path (a pair
    outside `SUPPORTED_DIMS`, storage TMA cannot read, rows narrower than the tile's box, or
    fewer rows than one box: `tma_view`)."""
    if (q.shape[-1], v.shape[-1]) not in SUPPORTED_DIMS:
        return None
    width_qk, width_v = widths(q.shape[-1], v.shape[-1])
    block_n = TILES[width_qk][0]
    views = (
        tma_view(q, varlen, WARPGROUP_ROWS),  # q is read in one box per warpgroup
        tma_view(k, varlen, block_n),
        tma_view(v, varlen, block_n),
    )
    if any(view is None for view in views):
        return None
    # A box wider than the grid's rows (one head of a dim below its tile width) is no legal TMA
    # box; such rows take the portable kernels.
    if any(view[0][1] < width for view, width in zip(views, (width_qk, width_qk, width_v))):
        return None
    return views


# The dynamic tile scheduler's counters, one int32 per (device, stream) (`tile_counter`).
_TILE_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def tile_counter(device: torch.device) -> torch.Tensor:
    """The zeroed int32 a causal persistent launch on the current stream takes its tiles from.

    Each launch leaves its counter at 0 (its last user resets it, `_persistent_producer`), and
    launches on one stream run in order, so one counter per stream serves them all without a
    fill per call (an allocation and a launch of host time). Under CUDA graph capture a launch
    gets a fresh zeroed counter instead: the capture's allocations belong to its graph (so does
    a launch off CUDA, which only the offline compile makes).
    """
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=device)
    # The raw stream handle, as the launch reads it (`torch.cuda.current_stream` builds a
    # Stream object: several microseconds a call).
    key = (device.index, _current_stream(device.index))
    counter = _TILE_COUNTERS.get(key)
    if counter is None:
        counter = _TILE_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def forward_sm90(
    q, k, v, out, lse, geom, *, softmax_scale, causal, bottom_right, signature=None
):  # fmt: skip
    """Launch `_attn_fwd_sm90` on validated input that TMA can read in place (`plan_views`
    says so: `dispatch.sm90_forward_plan`); out / lse are allocated by the caller, contiguous
    (zero / -inf filled wherever a row may see no key). `signature`: the call's
    `_common.attention_signature`; with it everything but the TMA descriptors' tensors and the
    pointers is planned once per signature (`_launch_plan`: the TMA grids depend on shapes,
    strides and 16-byte alignment only) and the launch goes straight to the compiled kernel
    after the first (`_launch.launch`); without it every call plans afresh and launches through
    Triton's `kernel[grid]` the first time per specialization."""
    settings = _settings(q.shape[-1], v.shape[-1], causal)
    plan = planned(
        _PLANS, signature, (bool(causal), bool(bottom_right), settings),
        lambda: _launch_plan(q, k, v, out, lse, geom, causal, bottom_right, signature),
    )  # fmt: skip
    if plan.grid[0] == 0:
        return
    q_desc, k_desc, v_desc, o_desc = plan.descriptors
    counter = tile_counter(q.device) if plan.dynamic else None
    args = (
        q_desc(q), k_desc(k), v_desc(v), o_desc(out), out, lse,
        geom.q.cu_seqlens, geom.q.seq_offsets, geom.q.seqlens,
        geom.k.cu_seqlens, geom.k.seq_offsets, geom.k.seqlens,
        *plan.ints, float(softmax_scale) * LOG2E, plan.order_pairs, plan.num_pairs, counter,
    )  # fmt: skip
    if not launch_bound(plan.slot, args):  # the constexprs' keywords only for the first launch
        launch(_attn_fwd_sm90, plan.grid, *args, **plan.constexprs, signature=plan.signature,
               slot=plan.slot)  # fmt: skip


class _LaunchPlan(NamedTuple):
    """What a launch of `_attn_fwd_sm90` derives from the call's signature (`_launch_plan`)."""

    grid: tuple[int]
    dynamic: bool  # a causal persistent grid: takes a tile counter
    descriptors: tuple  # makers of q's, k's, v's and out's TMA descriptors (`descriptor_maker`)
    ints: tuple  # strides of q, k, v, out, lse; heads, group, lengths
    order_pairs: int
    num_pairs: int
    constexprs: dict
    signature: tuple | None
    slot: dict | None


# Plans by (signature, causal, bottom_right, module settings) (`planned`).
_PLANS: dict[tuple, _LaunchPlan] = {}


def _settings(d: int, d_v: int, causal: bool) -> tuple:
    """The module settings a plan for head dims (d, d_v) reads (the A/B scripts flip them in
    one process)."""
    width = widths(d, d_v)[0]
    persistent = (PERSISTENT_CAUSAL if causal else PERSISTENT)[width]
    return (
        TILES[width], CONSUMERS[width], persistent, TMA_EPILOGUE[width],
        _common.CAUSAL_ORDER_L2_BYTES,
    )  # fmt: skip


def _launch_plan(q, k, v, out, lse, geom, causal, bottom_right, signature) -> _LaunchPlan:
    """Grid, runtime integers and constexprs of the launch: from shapes, strides, dtypes and
    devices only, so one plan serves every call of a signature."""
    d, d_v = q.shape[-1], v.shape[-1]
    width_qk, width_v = widths(d, d_v)
    block_n, stages = TILES[width_qk]
    num_heads_q, num_heads_kv = q.shape[-2], k.shape[-2]
    consumers = CONSUMERS[width_qk]
    block_m = WARPGROUP_ROWS * consumers
    max_registers, worker_registers = REGISTERS[consumers]
    num_pairs = geom.batch * num_heads_q
    tiles = cdiv(geom.q.max_len, block_m) * num_pairs
    persistent = (PERSISTENT_CAUSAL if causal else PERSISTENT)[width_qk]
    grid = (min(tiles, multiprocessors(q.device)) if persistent else tiles,)
    # The TMA store writes whole tile-wide rows: only where the tile is exactly v's width.
    o_tma = TMA_EPILOGUE[width_qk] and d_v == width_v
    # Causal tiles differ in length: a persistent causal launch takes them from a counter.
    dynamic = persistent and causal
    views = plan_views(q, k, v, geom.varlen)
    # TMA stores only rows inside their sequence (rows reaching past it take masked stores
    # from registers), so out may be shorter than one box.
    out_view = tma_view(out, geom.varlen, WARPGROUP_ROWS, storage_rows=WARPGROUP_ROWS)
    if views is None or out_view is None:  # `dispatch.sm90_forward_plan` sends these elsewhere
        raise ValueError(
            f"sm_90 forward: TMA cannot read q {q.stride()}, k {k.stride()}, v {v.stride()} "
            f"or write out {out.stride()} in place"
        )
    descriptors = tuple(
        descriptor_maker(t, view, [rows, width])
        for t, view, rows, width in zip(
            (q, k, v, out),
            (*views, out_view),
            (WARPGROUP_ROWS, block_n, block_n, WARPGROUP_ROWS),
            (width_qk, width_qk, width_v, width_v),
        )
    )
    sq, sk, sv, so = (strides4(t, geom.varlen) for t in (q, k, v, out))
    ints = (
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1], so[2],
        *lse_strides(lse, geom.varlen),
        num_heads_q, num_heads_q // num_heads_kv, geom.q.max_len, geom.k.max_len,
    )  # fmt: skip
    order_pairs = causal_order_heads(
        geom.k.max_len, head_row_bytes(k, v), num_heads_q // num_heads_kv, num_pairs
    )
    constexprs = dict(
        HEAD_DIM=d, HEAD_DIM_V=d_v, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages,
        SEQ_MODE_Q=geom.q.mode, SEQ_MODE_K=geom.k.mode, IS_CAUSAL=bool(causal),
        BOTTOM_RIGHT=bool(bottom_right), CONSUMER_REGS=worker_registers[0],
        PERSISTENT=persistent, DYNAMIC=dynamic, O_TMA=o_tma, num_warps=CONSUMER_WARPS,
        maxnreg=max_registers,
    )  # fmt: skip
    signature, slot = launch_binding(signature, order_pairs)
    return _LaunchPlan(
        grid, dynamic, descriptors, ints, order_pairs, num_pairs, constexprs, signature, slot
    )


__all__ = [
    "GLUON_AVAILABLE", "SUPPORTED_DIMS", "forward_sm90", "plan_views", "tma_view", "widths",
]  # fmt: skip
