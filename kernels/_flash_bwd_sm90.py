"""Flash-attention backward for Hopper (sm_90), written in Gluon: one launch for dQ, dK and dV.

Shapes (docs/internals.md), as for the portable backward in `_flash_bwd.py`:
    dense  q/dq [b, s_q, h_q, d], k/dk, v/dv [b, s_k, h_kv, d], dout [b, s_q, h_q, d],
           lse/delta [b, h_q, s_q]
    varlen q/dq [t_q, h_q, d], k/dk, v/dv [t_k, h_kv, d], dout [t_q, h_q, d], lse/delta [h_q, t_q]

One program owns BLOCK_N = 128 keys of one (sequence, KV head) and loops over every query block
of every query head of its GQA group that can see them (FlashAttention-3's backward):
- a producer warpgroup loads the K and V tiles once, then streams each (query head, query
  block)'s Q and dO tiles by TMA, and its LSE and delta rows by plain loads, through a
  NUM_STAGES-deep shared-memory ring (a "ready" mbarrier with the TMA's byte count and an
  "empty" one both consumers release);
- two consumer warpgroups each own 64 of the keys. Per query block of BLOCK_M = 64 rows, with
  asynchronous wgmma: S^T = K Q^T and dP^T = V dO^T (key-major, so P^T and dS^T come out of the
  products as the A operands of dV += P^T dO and dK += dS^T Q), P^T = exp2(S^T * scale * log2e
  - LSE), dS^T = P^T (dP^T - delta). P^T feeds dV from registers (`P_FROM_REGISTERS`); dS^T
  reaches the dK and dQ products through shared memory.
  Both warpgroups write their dS^T rows into one [128 keys, BLOCK_M] tile (double-buffered, an
  mbarrier both arrive on), from which this key block's dQ share dS K is computed (128-wide
  tiles: each warpgroup 64 of the columns; d = 64: the warpgroups take turns) and added into an fp32
  dQ accumulator by one TMA reduce-add per share from shared memory (FlashAttention-3's bulk
  reduction; the consumers issue no atomics). dK and dV sum over the group's heads in
  registers: no atomics, no partial sums.
- d = 64 runs BLOCK_M = 128 query rows per step (`TILES_M128`, FlashAttention-3's d = 64 tile; the
  default since it measured faster on the H100, `TILES`): half the per-step fixed costs (the
  stage's mbarrier wait and release, the dS^T barrier and its cross-warpgroup mbarrier, the dK
  wait) per query row. Each warpgroup runs the step as two [64 keys, 64 queries] halves on the
  64-row schedule (`_scores_by_halves`: dV per half, one dK product over the 128 queries) and
  computes 64 of the step's 128 dQ rows from the whole dS^T tile, one TMA reduce each. Registers
  (232 and 240 for the consumers, 32 for the producer, which spilled shared values at 24): dK and
  dV 2 x 32, one half's S^T and dP^T 2 x 32, its LSE and delta 16 each, loaded from shared memory
  where used, the dQ share 32 once both halves' tiles have died: 128 of accumulators at the peak,
  as at BLOCK_M = 64, 198 registers in all ([64, 128] score tiles would take 2 x 64 beside dK and
  dV, with 32-register query vectors, and spilled). Shared memory: 2 stages x (Q, dO) 64 KiB, K and
  V 32 KiB, two dS^T tiles [128, 128] 64 KiB, the dQ staging tiles 32 KiB, LSE/delta 2 KiB,
  barriers: 199,152 bytes with P^T in registers (P^T in shared memory adds 32 KiB: 231,936 of
  the 232,448 a block may have); a third stage would need 512 bytes more than the block has.
`_flash_bwd` allocates the accumulator (`dq_accumulator`), computes delta = rowsum(dO * O)
(minus the LSE's upstream gradient, when the loss reads the LSE) first and zeroes the
accumulator in the same launch (`_flash_bwd._preprocess`), and scales and casts it afterwards
(its atomic-dQ epilogue). So this kernel takes an LSE gradient with no change of its own.

Tiles are addressed as in the forward (`_sm90_common.tma_view`): one 2-D TMA grid over
each operand's storage, any layout whose heads sit inside one storage row. Rows past a
sequence's end (keys of the last key block, queries of the last query block) read whatever lies
there, NaN included: they are zeroed in shared memory before any product (0 x NaN is NaN) and
masked out of P; their dQ/dK/dV rows are never written.

Head dims between tile widths run on the next width up (`tile_width`), as in the forward: d = 80
and 96 run d = 128's configuration, 128-wide tiles (the same registers and shared memory: dK and
dV 2 x 64 registers a thread). Their 128-wide TMA boxes read columns past d (the next head's
data, or TMA's zero fill at a row's end; anything, NaN included), so S^T and dP^T take the dim's
own columns only (two products, 64 + 16 for 80 and 64 + 32 for 96: `_product_over_dim`); dK and
dV columns past d sum that garbage and are never stored (masked stores); dQ's are added into the
accumulator's padding, which is `tile_width(d)` columns a head (`dq_accumulator`) and read back
to d columns only (`_flash_bwd._scaled_dq`).

d = 160, 192 and 256, and (d_qk, d_v) = (192, 128), run another schedule on 256-wide tiles: 64
keys a program, both consumer warpgroups on the same keys, each holding half of dK's and dV's
columns (`_flash_bwd_sm90_wide`, docs/design-sm90-backward-wide.md); 160 and 192 leave the
tiles' columns past d out as 80 and 96 do. Each dims pair runs the variants of that schedule
`WIDE_DEFAULTS` gives it (the split ring at (192, 128), dV before dS^T at 160 and 192).

Covered: fp16/bf16, (d_qk, d_v) in `SUPPORTED_DIMS` (64, 80, 96, 128, 160, 192, 256 with
d_v = d_qk, and (192, 128)), MHA/GQA/MQA, no mask / causal (both alignments), dense,
right-padded and varlen; below a tile width only storage whose rows are at least one box wide
(one KV head of 96 columns in rows 96 wide is not, nor one of 160 or 192: `plan_views`). dQ
is not bitwise reproducible (the order of the fp32 atomic adds varies), so `deterministic=True`
takes the portable two-pass backward, as does everything else not covered
(`dispatch.sm90_backward_plan`).

Precision: as the portable backward. Products accumulate in fp32; P^T and dS^T are rounded to
the input dtype for the dV, dK and dQ products; dK leaves multiplied by the softmax scale, dQ
is scaled in the epilogue.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from . import _common
from ._common import (
    LOG2E,
    causal_order_heads,
    cdiv,
    empty,
    head_row_bytes,
    lse_strides,
    planned,
    strides4,
    zeros,
)
from ._launch import launch, launch_bound
from ._sm90_common import (
    GLUON_AVAILABLE,
    descriptor_maker,
    launch_binding,
    tile_width,
    tma_view,
)

if GLUON_AVAILABLE:
    from ._flash_bwd_sm90_steps import (
        _opaque_zero,
        _owns_dq,
        _reduce_dq,
        _scores_by_halves,
        _visible_keys,
        _wait_dv,
    )
    from ._flash_bwd_sm90_wide import _consumer_wide
    from ._sm90_common import (
        _interleaved_tile,
        _partition_barrier,
        _product_over_dim,
        _release,
        _seq_bounds,
        _tile_origin,
        _tma_load,
        _zero_rows_from,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )


BLOCK_N = 128  # keys per program: two consumer warpgroups of 64 (a wgmma's M per warpgroup)
# Keys per program per tile width (`block_n`): 128 up to 128-wide tiles; 64 at 256 (d = 192,
# 256), where both consumer warpgroups share the 64 keys and split dK's and dV's columns
# (`_flash_bwd_sm90_wide`; docs/design-sm90-backward-wide.md).
KEYS_PER_PROGRAM = {64: BLOCK_N, 128: BLOCK_N, 256: 64}
CONSUMER_WARPS = 4
# Registers as in the forward: two consumer warpgroups and a four-warp producer, 168 x 384
# threads fill the register file; the producer keeps 24, each consumer gets 240.
MAX_REGISTERS = 168
# (BLOCK_M query rows per step, NUM_STAGES) per tile width. d = 128: 64-row steps, the score tiles
# [64 keys, 64 queries] a warpgroup; the dK and dV accumulators take 2 x 64 registers a thread
# (FlashAttention-3's choice), leaving none for wider steps. Shared memory: K, V, two dS^T
# tiles, the dQ staging tiles and NUM_STAGES x (Q, dO): 194 KiB with P^T in registers (210 with
# it in shared memory); a third stage fits then (226 KiB) but measured 0.6-3.2% slower.
# d = 64: 128-row steps (`TILES_M128`, module docstring; 195 KiB, a third stage 512 bytes too
# many), each run as two 64-query halves: on the H100 its backward read 1.06-1.12x the 64-row
# step's at s = 4k and 16k (0.92-1.02x at 1k; docs/performance.md); `TILES[64] = (64, 2)`
# selects the 64-row step again.
# d = 160, 192 and 256 (256-wide tiles): 64-row steps and one stage; a second one (64 KiB
# more) does not fit beside the dQ staging tiles (docs/design-sm90-backward-wide.md); (192, 128)
# runs a second Q stage (`WIDE_DEFAULTS`: the split ring).
TILES = {128: (64, 2), 64: (128, 2), 256: (64, 1)}
# The 128-row step variant (tests and examples/perf/tune_sm90_backward.py --block-m pin it).
TILES_M128 = {64: (128, 2)}
# Per head dim, the order of a step's last products. True issues dQ before dK (FlashAttention-3's
# order): the dQ share's trip to shared memory and its TMA reduce overlap the dK product, and the
# stage is released once dK lands. False issues dK first, so it is queued while the warpgroup
# waits for the other's dS^T, and releases the stage before the dQ epilogue. Measured on the
# H100 (forward+backward, one process): d = 128 +2-3% at 4k and 16k (causal 4k -1%); d = 64,
# whose 128-row step has a dK product twice as long, -2-3% (docs/performance.md).
# The wide schedule (256) has one order (dV, dK, dQ) and reads none of the three tables below.
DQ_BEFORE_DK = {128: True, 64: False, 256: True}
# Per head dim: where a consumer waits until its previous dQ reduce has read the staging tile.
# True: just before it stores the next share there; False: at the step's start, behind the
# S^T and dP^T issue (ptxas hoists that wait between their wgmma chains).
DQ_WAIT_LATE = {128: True, 64: True, 256: True}
# Per head dim: dV += P^T dO takes P^T from registers (True; wgmma's A operand may be) or from
# shared memory (False). From registers saves the tile's trip through shared memory (a store,
# the product's read, a fence and a barrier a step, per half of a 128-row step), whose
# bandwidth the consumers wait on (Nsight Compute: MIO-queue stalls lead theirs at d=128), for
# 16 more registers a thread held until dV lands.
P_FROM_REGISTERS = {128: True, 64: True, 256: False}
# The wide schedule's variants (256-wide tiles; docs/design-sm90-backward-wide.md, "Variants"),
# by name: the launch constexprs each sets over the schedule's own (`TILES[256]`'s one stage for
# Q and dO alike, dV issued after dS^T).
# - split_ring: two Q stages (with their LSE rows), one dO stage (with its delta rows), each
#   with its own ready/empty barriers, so the next step's Q loads a whole step ahead. Fits
#   beside 128-wide v/dO tiles only (`wide_variant_fits`): at (192, 128), 229,968 bytes of
#   232,448; 262,744 at 192 and 256.
# - dv_early: each step's dV product issued as soon as both warpgroups' P^T halves are in
#   shared memory (a P-ready mbarrier apart from dS-ready), so it runs while dS^T is computed.
WIDE_VARIANTS = {
    "split_ring": {"NUM_STAGES": 2, "DO_STAGES": 1},
    "dv_early": {"DV_EARLY": True},
}
# Which variants run, per (d_qk, d_v) on 256-wide tiles: the one place that decides it
# (`wide_settings`; examples/perf/ab_sm90_variants.py --set wide flips each). Forward+backward
# on an H200: the split ring 1.18-1.29x the one-stage ring at (192, 128) (with dv_early too,
# slightly less); dv_early 1.07-1.11x at 192, 0.99-1.01x at 256. 160 runs 192's tiles and
# takes 192's choice.
WIDE_DEFAULTS: dict[tuple[int, int], tuple[str, ...]] = {
    (160, 160): ("dv_early",), (192, 192): ("dv_early",), (256, 256): (),
    (192, 128): ("split_ring",),
}  # fmt: skip
# The tables here are per tile width (`tile_width`): d = 80 and 96 run on d = 128's tiles, 128
# columns wide, as in the forward. Their S^T and dP^T take the dim's own columns only (two
# products, `_product_over_dim`); the tiles' other columns (the next head's, or TMA's zero fill
# at a row's end: anything, NaN included) reach only dK, dV and dQ columns past d, which are
# never stored (dK, dV) or land in the accumulator's padding (`dq_accumulator`). The registers
# and shared memory are d = 128's. d = 160 and 192 run on 256-wide tiles the same way;
# (192, 128) on 256-wide q/k tiles and 128-wide v/dO tiles (`widths`). Covered: (d_qk, d_v) pairs.
SUPPORTED_DIMS = (
    (64, 64), (80, 80), (96, 96), (128, 128), (160, 160), (192, 192), (256, 256), (192, 128),
)  # fmt: skip


def widths(d_qk: int, d_v: int) -> tuple[int, int]:
    """(q's and k's tile width, v's and dO's); the tables are keyed by the first."""
    return tile_width(d_qk), tile_width(d_v)


def wide_variant_fits(name: str, d_qk: int, d_v: int) -> bool:
    """Whether variant `name` (`WIDE_VARIANTS`) fits shared memory at (d_qk, d_v), on 256-wide
    tiles: a second Q stage does only beside 128-wide v/dO tiles."""
    width, width_v = widths(d_qk, d_v)
    return width > 128 and ("DO_STAGES" not in WIDE_VARIANTS[name] or width_v <= 128)


def wide_settings(d_qk: int, d_v: int) -> dict:
    """The launch constexprs that the variants `WIDE_DEFAULTS` runs at (d_qk, d_v) set (none
    for dims it does not list, below 256-wide tiles among them); ValueError for a variant that
    does not fit there (`wide_variant_fits`)."""
    settings = {}
    for name in WIDE_DEFAULTS.get((d_qk, d_v), ()):
        if not wide_variant_fits(name, d_qk, d_v):
            raise ValueError(f"sm_90 backward: the wide variant {name} does not fit d={d_qk}/{d_v}")
        settings.update(WIDE_VARIANTS[name])
    return settings


def block_n(d_qk: int) -> int:
    """Keys per program at head dim d_qk (`KEYS_PER_PROGRAM`)."""
    return KEYS_PER_PROGRAM[tile_width(d_qk)]


def dq_box(d_qk: int) -> tuple[int, int]:
    """Each consumer warpgroup's dQ share per step, [rows, columns] of fp32: [64, 64] up to
    128-wide tiles, [64, 128] (half the width) at 256 (`_flash_bwd_sm90_wide`)."""
    width = tile_width(d_qk)
    return (64, width // 2) if width > 128 else DQ_BOX


if GLUON_AVAILABLE:

    @gluon.jit
    def _producer(descs, smem, bars, seq, strides, ptrs, scales):
        """K and V once, then Q, dO, LSE and delta of every (group head, query block) step
        into the ring."""
        q_desc, k_desc, v_desc, do_desc, dq_desc = descs
        q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, p_smem, dq_smem = smem
        kv_bar, ready, empty, ds_ready, ready_do, empty_do = bars[:6]
        z, h_kv, group, start_q, start_k, start_n, len_q, len_k, diag, m_lo, m_count, total = seq
        stride_qb, stride_qh, stride_qs = strides[0]
        stride_kb, stride_kh, stride_ks = strides[1]
        stride_vb, stride_vh, stride_vs = strides[2]
        stride_dob, stride_doh, stride_dos = strides[3]
        stride_lb, stride_lh, stride_ls = strides[4]
        NUM_STAGES: gl.constexpr = q_smem.type.shape[0]
        DO_STAGES: gl.constexpr = do_smem.type.shape[0]
        BLOCK_M: gl.constexpr = q_smem.type.shape[1]

        k_row, k_col = _tile_origin(z, h_kv, start_k + start_n, stride_kb, stride_kh, stride_ks)
        v_row, v_col = _tile_origin(z, h_kv, start_k + start_n, stride_vb, stride_vh, stride_vs)
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [k_row, k_col], kv_bar, k_smem.index(0))
        _tma_load(v_desc, [v_row, v_col], kv_bar, v_smem.index(0))
        lse_ptr, delta_ptr = ptrs[:2]
        # One row a thread (the 128 threads hold BLOCK_M rows, repeated where fewer).
        offs = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [4], [0]))
        z64 = z.to(gl.int64)
        for it in range(total):
            stage = it % NUM_STAGES
            # Empty barriers start "completed" for parity 1: the first lap never waits.
            phase = ((it // NUM_STAGES) & 1) ^ 1
            g = it // m_count
            m0 = m_lo + (it - g * m_count) * BLOCK_M
            h = h_kv * group + g
            q_row, q_col = _tile_origin(z, h, start_q + m0, stride_qb, stride_qh, stride_qs)
            do_row, do_col = _tile_origin(z, h, start_q + m0, stride_dob, stride_doh, stride_dos)
            if DO_STAGES != NUM_STAGES:
                # The split ring (`WIDE_VARIANTS`): Q and its LSE rows into Q's stage, then dO and
                # its delta rows into dO's, each behind its own empty barrier.
                rows = m0 + offs
                lse_at = (z64 * stride_lb + h.to(gl.int64) * stride_lh
                          + start_q.to(gl.int64) * stride_ls)  # fmt: skip
                row_ok = rows < len_q
                mbarrier.wait(empty.index(stage), phase)
                lse = gl.load(lse_ptr + lse_at + rows * stride_ls, mask=row_ok, other=0.0)
                lse_smem.index(stage).store(lse)
                _partition_barrier()
                mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes)
                _tma_load(q_desc, [q_row, q_col], ready.index(stage), q_smem.index(stage))
                stage_do = it % DO_STAGES
                mbarrier.wait(empty_do.index(stage_do), ((it // DO_STAGES) & 1) ^ 1)
                delta = gl.load(delta_ptr + lse_at + rows * stride_ls, mask=row_ok, other=0.0)
                delta_smem.index(stage_do).store(delta)
                _partition_barrier()
                mbarrier.expect(ready_do.index(stage_do), do_desc.block_type.nbytes)
                _tma_load(
                    do_desc, [do_row, do_col], ready_do.index(stage_do), do_smem.index(stage_do)
                )
            else:
                mbarrier.wait(empty.index(stage), phase)
                # LSE and delta by plain loads (a 1-D TMA box must start 16-byte aligned, and a
                # sequence's rows start anywhere), into shared memory before the arrive below.
                rows = m0 + offs
                lse_at = (z64 * stride_lb + h.to(gl.int64) * stride_lh
                          + start_q.to(gl.int64) * stride_ls)  # fmt: skip
                row_ok = rows < len_q
                lse = gl.load(lse_ptr + lse_at + rows * stride_ls, mask=row_ok, other=0.0)
                delta = gl.load(delta_ptr + lse_at + rows * stride_ls, mask=row_ok, other=0.0)
                lse_smem.index(stage).store(lse)
                delta_smem.index(stage).store(delta)
                _partition_barrier()  # every producer thread's stores, before the arrive
                mbarrier.expect(
                    ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                )
                _tma_load(q_desc, [q_row, q_col], ready.index(stage), q_smem.index(stage))
                _tma_load(do_desc, [do_row, do_col], ready.index(stage), do_smem.index(stage))

    @gluon.jit
    def _consumer(
        args, WG: gl.constexpr, DQ_FIRST: gl.constexpr, WAIT_LATE: gl.constexpr,
        P_IN_REGS: gl.constexpr, HEAD_DIM: gl.constexpr,
    ):  # fmt: skip
        """One warpgroup: dK and dV of its 64 keys, and its half of each step's dQ share (its
        64 columns of 128-wide tiles, every other step's share at d = 64, its 64 rows of each
        step's at BLOCK_M = 128). `args` is the producer's argument list (a partition's
        constants must sit at the top of its own); DQ_FIRST: see `DQ_BEFORE_DK`; WAIT_LATE:
        see `DQ_WAIT_LATE`; P_IN_REGS: see `P_FROM_REGISTERS`; HEAD_DIM: q's and v's head dim,
        at most the tiles' width (`tile_width`): the columns S^T and dP^T sum over and dK and dV
        store."""
        descs, smem, bars, seq, strides, ptrs, scales = args
        q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, p_smem, dq_smem = smem
        kv_bar, ready, empty, ds_ready = bars[:4]
        z, h_kv, group, start_q, start_k, start_n, len_q, len_k, diag, m_lo, m_count, total = seq
        dq_desc = descs[4]
        stride_dqb, stride_dqh, stride_dqs = strides[5]
        stride_dkb, stride_dkh, stride_dks = strides[6]
        stride_dvb, stride_dvh, stride_dvs = strides[7]
        dk_ptr, dv_ptr = ptrs[2:]
        qk_scale, sm_scale = scales
        NUM_STAGES: gl.constexpr = q_smem.type.shape[0]
        BLOCK_M: gl.constexpr = q_smem.type.shape[1]
        WIDTH: gl.constexpr = q_smem.type.shape[2]  # the tiles' columns (`tile_width`)
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        KEYS: gl.constexpr = BLOCK_N // 2
        # Each step's dQ share dS K is [BLOCK_M, WIDTH]. BLOCK_M = 64, 128-wide tiles: each
        # warpgroup computes 64 of the columns (its accumulator beside dK and dV must stay at
        # 32 registers; at d = 80 and 96 the second one's columns past d come from the K
        # tile's garbage and land in the accumulator's padding); BLOCK_M = 64, d = 64: the
        # warpgroups take turns computing all of it, one step each; BLOCK_M = 128 (d = 64
        # only): each warpgroup computes 64 of the rows.
        DQ_COLS: gl.constexpr = 64
        SPLIT_ROWS: gl.constexpr = BLOCK_M == 128
        gl.static_assert(BLOCK_M == 64 or (BLOCK_M == 128 and WIDTH == 64))
        gl.static_assert(WIDTH // 2 < HEAD_DIM and HEAD_DIM <= WIDTH)
        gl.static_assert(not SPLIT_ROWS or HEAD_DIM == WIDTH)  # `_scores_by_halves`: whole tiles
        ALTERNATE: gl.constexpr = WIDTH == DQ_COLS and not SPLIT_ROWS
        dq_col0: gl.constexpr = WG * DQ_COLS if WIDTH > DQ_COLS else 0
        dq_row0: gl.constexpr = WG * 64 if SPLIT_ROWS else 0
        ZERO_CHUNK: gl.constexpr = 128 if SPLIT_ROWS else 16
        dtype: gl.constexpr = q_smem.dtype

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
        )
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WIDTH, 16]
        )
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16]
        )
        p_op_layout: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=acc_layout, k_width=2
        )

        # Query-indexed vectors of a key-major tile hold BLOCK_M / 4 values a thread: LSE and
        # delta come from shared memory when needed, the mask's indices only on masked steps.
        q_vec: gl.constexpr = gl.SliceLayout(0, s_layout)
        zero_s = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
        zero_dq = gl.zeros([64, DQ_COLS], gl.float32, dq_layout)
        # dK and dV over the tiles' whole width: columns past HEAD_DIM are never stored.
        dk = gl.zeros([KEYS, WIDTH], gl.float32, acc_layout)
        dv = gl.zeros([KEYS, WIDTH], gl.float32, acc_layout)
        # The key block's steps that need the mask: query blocks reaching past len_q, every step
        # of a key block reaching past len_k, and (causal) blocks starting below the last key's
        # diagonal row.
        key_edge = start_n + BLOCK_N > len_k
        diag_rows = start_n + BLOCK_N - 1 - diag
        z64 = z.to(gl.int64)

        mbarrier.wait(kv_bar, 0)
        _zero_rows_from(k_smem.index(0), len_k - start_n, ZERO_CHUNK)
        _zero_rows_from(v_smem.index(0), len_k - start_n, ZERO_CHUNK)
        dq_wg = dq_smem.index(WG)
        for it in range(total):
            # Shared-memory addresses through an index the compiler cannot see is 0: else it
            # hoists every wgmma descriptor of the resident tiles out of the loop (dozens of
            # 64-bit values) and spills them.
            res = _opaque_zero(it)
            k_res = k_smem.index(res)
            v_res = v_smem.index(res)
            k_wg = k_res.slice(WG * KEYS, KEYS)
            v_wg = v_res.slice(WG * KEYS, KEYS)
            # dS^T reaches the dK and dQ products through shared memory (the dQ product needs
            # both warpgroups' rows); P^T the dV product too unless P_IN_REGS. The compiler
            # drops p_smem when nothing uses it.
            p_wg = p_smem.index(res).slice(WG * KEYS, KEYS)
            if WIDTH == DQ_COLS:
                k_dq = k_res
            else:
                k_dq = k_res.slice(WG * DQ_COLS, DQ_COLS, dim=1)
            stage = it % NUM_STAGES
            g = it // m_count
            m0 = m_lo + (it - g * m_count) * BLOCK_M
            p_ops = (None, None)  # P^T's registers while dV is in flight (P_IN_REGS)
            mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
            q_t = q_smem.index(stage)
            do_t = do_smem.index(stage)
            _zero_rows_from(q_t, len_q - m0, ZERO_CHUNK)
            _zero_rows_from(do_t, len_q - m0, ZERO_CHUNK)
            if SPLIT_ROWS:
                buf = it % 2
                ds_buf = ds_smem.index(buf)
                ds_wg = ds_buf.slice(WG * KEYS, KEYS)
                masked = key_edge | (m0 + BLOCK_M > len_q) | (m0 < diag_rows)
                rows = (lse_smem.index(stage), delta_smem.index(stage))
                # `res` (0): key indices the compiler cannot hoist out of the loop (their
                # predicates, kept across it, spilled)
                bounds = (start_n + WG * KEYS + res, m0, len_q, len_k, diag)
                pending = _scores_by_halves(
                    k_wg, v_wg, q_t, do_t, p_wg, ds_wg, rows, dv, qk_scale, masked, bounds,
                    WAIT_LATE, P_IN_REGS,
                )  # fmt: skip
                if P_IN_REGS:
                    dv_tok, p_last = pending
                    p_ops = (p_last, None)
                else:
                    dv_tok = pending
            else:
                # S^T = K Q^T and dP^T = V dO^T over the dim's own columns (two products each
                # at d = 80 and 96; the waits below count groups from the latest, so an extra
                # earlier one changes nothing).
                s_tok = _product_over_dim(k_wg, q_t, zero_s, HEAD_DIM)
                dp_tok = _product_over_dim(v_wg, do_t, zero_s, HEAD_DIM)
                if not WAIT_LATE:
                    # The previous step's dQ reduce has read `dq_wg` before it is stored into
                    # again (at this step's end, after the P^T barrier below orders every thread
                    # after this).
                    tma.store_wait(0)
                # Rows that saw no key carry LSE -inf; their P is masked to 0, and any finite
                # stand-in keeps exp2 from producing NaN first.
                lse = lse_smem.index(stage).load(q_vec)
                lse2 = gl.where(lse == float("-inf"), 0.0, lse) * LOG2E
                s_t = warpgroup_mma_wait(1, deps=[s_tok])
                # exp2 with log2(e) folded into qk_scale and the LSE: one FMA per score.
                p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
                masked = key_edge | (m0 + BLOCK_M > len_q) | (m0 < diag_rows)
                if masked:
                    p_t = _visible_keys(p_t, start_n + WG * KEYS, m0, len_q, len_k, diag)
                if P_IN_REGS:
                    # P^T [keys, queries] is the A operand of dV += P^T dO as it stands: its
                    # registers go to the product, kept live until dV lands (`_wait_dv`).
                    p_op = gl.convert_layout(p_t.to(dtype), p_op_layout)
                    dv_tok = warpgroup_mma(p_op, do_t, dv, is_async=True)
                    p_ops = (p_op, None)
                else:
                    p_wg.store(p_t.to(dtype))
                    fence_async_shared()
                    _partition_barrier()
                    dv_tok = warpgroup_mma(p_wg, do_t, dv, is_async=True)
                delta = delta_smem.index(stage).load(q_vec)
                # wgmma groups retire in issue order: one outstanding (dV) means dP^T landed.
                dp_t = warpgroup_mma_wait(1, deps=[dp_tok])
                ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
                if masked:
                    # Delta past a sequence's end may be anything (never written): 0 x NaN.
                    ds_t = _visible_keys(ds_t, start_n + WG * KEYS, m0, len_q, len_k, diag)
                ds_t = ds_t.to(dtype)

                # dS^T into this warpgroup's rows of the shared tile: the dK product reads them,
                # the dQ product both warpgroups' rows, so each waits for the other's
                # (generic-proxy stores read by wgmma: fence first).
                buf = it % 2
                ds_buf = ds_smem.index(buf)
                ds_wg = ds_buf.slice(WG * KEYS, KEYS)
                ds_wg.store(ds_t)
            fence_async_shared()
            _partition_barrier()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            if not DQ_FIRST:
                dk_tok = warpgroup_mma(ds_wg, q_t, dk, is_async=True)
            # dV and dK landing frees the stage's Q and dO and this warpgroup's P^T rows. The
            # other warpgroup overwrites this dS^T buffer only two steps on, after it has passed
            # the next step's barrier, which the warpgroup reading it here reaches only after
            # its dQ product landed.
            if _owns_dq(it, WG, ALTERNATE):
                mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)
                if SPLIT_ROWS:  # dS [this warpgroup's 64 queries, all 128 keys]
                    ds_dq = ds_buf.slice(dq_row0, 64, dim=1).permute((1, 0))
                else:
                    ds_dq = ds_buf.permute((1, 0))
                dq_tok = warpgroup_mma(ds_dq, k_dq, zero_dq, use_acc=False, is_async=True)
                if DQ_FIRST:
                    # dK after dQ: the dQ share's trip to shared memory and its TMA reduce then
                    # run while the tensor cores work on dK (groups retire in issue order: one
                    # outstanding means dV and dQ landed).
                    dk_tok = warpgroup_mma(ds_wg, q_t, dk, is_async=True)
                    dv, dq = _wait_dv(1, dv_tok, dq_tok, p_ops, P_IN_REGS)
                else:
                    dv, dk = _wait_dv(1, dv_tok, dk_tok, p_ops, P_IN_REGS)
                    _release(empty.index(stage))
                    dq = warpgroup_mma_wait(0, deps=[dq_tok])
                # The accumulator is contiguous (`dq_accumulator`): a sequence's rows start at a
                # whole grid row and head h at column h * stride_h, so no division (a 64-bit one
                # is a subroutine call; a 32-bit one some twenty instructions a step) is needed.
                dq_row = z * (stride_dqb // stride_dqs) + start_q + m0 + dq_row0
                dq_col = (h_kv * group + g) * stride_dqh
                if WAIT_LATE:
                    # The previous step's reduce has read `dq_wg` (its issuing thread waits, the
                    # barrier tells the others): waited for here, a step after the reduce was
                    # issued, not at the step's start, where the wait held up the S^T and dP^T
                    # products' issue behind the TMA unit's backlog (Nsight Compute, d=128).
                    tma.store_wait(0)
                    _partition_barrier()
                _reduce_dq(dq, dq_wg, dq_desc, dq_row, dq_col + dq_col0)
                if DQ_FIRST:
                    dk = warpgroup_mma_wait(0, deps=[dk_tok])
                    _release(empty.index(stage))
            else:
                if DQ_FIRST:
                    dk_tok = warpgroup_mma(ds_wg, q_t, dk, is_async=True)
                dv, dk = _wait_dv(0, dv_tok, dk_tok, p_ops, P_IN_REGS)
                _release(empty.index(stage))
        tma.store_wait(0)  # the last reduce's read of shared memory, before the program ends

        # Epilogue: this warpgroup's dK (times the softmax scale) and dV rows.
        if SPLIT_ROWS:
            # The strides' 64-bit forms made here, not before the partitions split: computed
            # there they stay live through every partition (the producer's 24 registers
            # included) and spilled.
            fresh = _opaque_zero(total)
            stride_dkb, stride_dkh, stride_dks = (stride_dkb + fresh, stride_dkh + fresh,
                                                  stride_dks + fresh)  # fmt: skip
            stride_dvb, stride_dvh, stride_dvs = (stride_dvb + fresh, stride_dvh + fresh,
                                                  stride_dvs + fresh)  # fmt: skip
        out_r = start_n + WG * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
        out_c = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, acc_layout))
        # Columns past HEAD_DIM (d = 80, 96) summed the tiles' garbage: never stored.
        out_mask = gl.expand_dims(out_r < len_k, 1) & gl.expand_dims(out_c < HEAD_DIM, 0)
        row_at = (start_k + out_r).to(gl.int64)
        dk_base = z64 * stride_dkb + h_kv.to(gl.int64) * stride_dkh
        dk_ptrs = dk_ptr + dk_base + gl.expand_dims(row_at * stride_dks, 1)
        gl.store(dk_ptrs + gl.expand_dims(out_c, 0), (dk * sm_scale).to(dtype), mask=out_mask)
        dv_base = z64 * stride_dvb + h_kv.to(gl.int64) * stride_dvh
        dv_ptrs = dv_ptr + dv_base + gl.expand_dims(row_at * stride_dvs, 1)
        gl.store(dv_ptrs + gl.expand_dims(out_c, 0), dv.to(dtype), mask=out_mask)

    @gluon.jit
    def _attn_bwd_sm90(
        q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
        cu_q_ptr, offsets_q_ptr, seqlens_q_ptr, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr,
        stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
        stride_lb, stride_lh, stride_ls, stride_dqb, stride_dqs, stride_dqh,
        stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
        num_heads_kv, group, full_len_q, full_len_k, qk_scale, sm_scale, order_pairs,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, SEQ_MODE_Q: gl.constexpr, SEQ_MODE_K: gl.constexpr,
        IS_CAUSAL: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, DQ_FIRST: gl.constexpr,
        WAIT_LATE: gl.constexpr, P_IN_REGS: gl.constexpr, HEAD_DIM_V: gl.constexpr,
        DO_STAGES: gl.constexpr, DV_EARLY: gl.constexpr,
    ):  # fmt: skip
        """One program: BLOCK_N keys of one (sequence, KV head), over its GQA group's queries;
        order_pairs: the causal launch order's interleave (`_interleaved_tile`); HEAD_DIM,
        HEAD_DIM_V: q's and v's head dims; the tiles are as wide as the descriptors' boxes
        (`widths`). Tiles wider than 128 take the column-split consumers
        (`_flash_bwd_sm90_wide`); DO_STAGES (the dO ring's stages, NUM_STAGES but for the split
        ring) and DV_EARLY are their variants (`WIDE_VARIANTS`)."""
        # Key blocks vary fastest (neighbours share the group's Q and dO in L2); under a causal
        # mask the first key blocks see the most queries, and they start first.
        pid = gl.program_id(0)
        num_n = gl.cdiv(full_len_k, BLOCK_N)
        if IS_CAUSAL:
            bh, n_idx = _interleaved_tile(pid, num_n, gl.num_programs(0) // num_n, order_pairs)
        else:
            bh = pid // num_n
            n_idx = pid % num_n
        start_n = n_idx * BLOCK_N
        z = bh // num_heads_kv
        h_kv = bh % num_heads_kv
        start_k, len_k = _seq_bounds(
            z, cu_k_ptr, offsets_k_ptr, seqlens_k_ptr, full_len_k, SEQ_MODE_K
        )
        if start_n >= len_k:
            return  # rows past the sequence: the launcher zero-filled them
        start_q, len_q = _seq_bounds(
            z, cu_q_ptr, offsets_q_ptr, seqlens_q_ptr, full_len_q, SEQ_MODE_Q
        )
        # Query rows that see some key of [start_n, start_n + BLOCK_N): i >= start_n - diag.
        m_lo = len_q * 0
        diag = len_k  # without a mask every key below len_k is visible to every row
        if IS_CAUSAL:
            diag = len_q * 0
            if BOTTOM_RIGHT:
                diag = len_k - len_q
            m_lo = (gl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        m_count = gl.cdiv(gl.maximum(len_q - m_lo, 0), BLOCK_M)
        total = group * m_count  # may be 0: dK = dV = 0 are still written

        dtype: gl.constexpr = q_desc.dtype
        WIDTH: gl.constexpr = q_desc.block_type.shape[1]  # the tiles' (`widths`)
        WIDTH_V: gl.constexpr = v_desc.block_type.shape[1]
        WIDE: gl.constexpr = WIDTH > 128  # `_flash_bwd_sm90_wide`'s schedule
        q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, WIDTH], q_desc.layout)
        # The split ring (DO_STAGES != NUM_STAGES, wide tiles only): dO and delta have their own
        # stages and ready/empty barriers (`WIDE_VARIANTS`).
        SPLIT_RING: gl.constexpr = DO_STAGES != NUM_STAGES
        gl.static_assert(WIDE or not (SPLIT_RING or DV_EARLY))
        do_smem = gl.allocate_shared_memory(dtype, [DO_STAGES, BLOCK_M, WIDTH_V], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, WIDTH], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, WIDTH_V], v_desc.layout)
        # dS^T [keys, queries], double-buffered; the dQ product reads it transposed. Wide
        # tiles: dS and P [queries, keys] (BLOCK_M = BLOCK_N = 64), both double-buffered.
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth, rank=2
        )
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        P_BUFFERS: gl.constexpr = 2 if WIDE else 1
        p_smem = gl.allocate_shared_memory(dtype, [P_BUFFERS, BLOCK_N, BLOCK_M], ds_layout)  # P^T
        # Each consumer warpgroup's dQ share on its way to the TMA reduce (`_reduce_dq`).
        DQ_ROWS: gl.constexpr = dq_desc.block_type.shape[0]
        DQ_COLS: gl.constexpr = dq_desc.block_type.shape[1]
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, DQ_ROWS, DQ_COLS], dq_desc.layout)
        rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], rows_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [DO_STAGES, BLOCK_M], rows_layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], bar_layout)
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # free once both warpgroups released it
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)  # both warpgroups' dS^T rows written
        # The variants' barriers; without them the names alias the default's, unused.
        ready_do = ready
        empty_do = empty
        p_ready = ds_ready
        if SPLIT_RING:
            ready_do = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], bar_layout)
            empty_do = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], bar_layout)
            for i in gl.static_range(DO_STAGES):
                mbarrier.init(ready_do.index(i), count=1)
                mbarrier.init(empty_do.index(i), count=2)
        if DV_EARLY:
            p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
            for i in gl.static_range(2):
                mbarrier.init(p_ready.index(i), count=2)  # both warpgroups' P^T rows written
        fence_async_shared()

        args = (
            (q_desc, k_desc, v_desc, do_desc, dq_desc),
            (q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, p_smem, dq_smem),
            (kv_bar, ready, empty, ds_ready, ready_do, empty_do, p_ready),
            (z, h_kv, group, start_q, start_k, start_n, len_q, len_k, diag, m_lo, m_count, total),
            ((stride_qb, stride_qh, stride_qs), (stride_kb, stride_kh, stride_ks),
             (stride_vb, stride_vh, stride_vs), (stride_dob, stride_doh, stride_dos),
             (stride_lb, stride_lh, stride_ls), (stride_dqb, stride_dqh, stride_dqs),
             (stride_dkb, stride_dkh, stride_dks), (stride_dvb, stride_dvh, stride_dvs)),
            (lse_ptr, delta_ptr, dk_ptr, dv_ptr), (qk_scale, sm_scale),
        )  # fmt: skip
        if WIDE:
            gl.warp_specialize(
                [
                    (_consumer_wide, (args, 0, HEAD_DIM, HEAD_DIM_V, DV_EARLY)),
                    (_consumer_wide, (args, 1, HEAD_DIM, HEAD_DIM_V, DV_EARLY)),
                    (_producer, args),
                ],  # fmt: skip
                [4, 4],
                # The producer at 24 registers spilled (21 stores); at 32 it spills 11 and the
                # consumers 72 bytes in all instead of 112 (offline compile, Triton 3.9).
                [232, 32],
            )
        else:
            gl.warp_specialize(
                [
                    (_consumer, (args, 0, DQ_FIRST, WAIT_LATE, P_IN_REGS, HEAD_DIM)),
                    (_consumer, (args, 1, DQ_FIRST, WAIT_LATE, P_IN_REGS, HEAD_DIM)),
                    (_producer, args),
                ],  # fmt: skip
                [4, 4],  # consumer warpgroup 1, and the producer as a whole warpgroup (forward)
                # The default partition gets the rest: 3 x 168 - 240 - 24 = 240. With 128-row
                # steps the producer gets 32: values the partitions share stay live through all
                # three (LLVM recomputes them in each), and 24 registers spilled some; consumer 1
                # then has 232, above the 198 the consumers use (offline compile, Triton 3.6).
                [240, 24] if BLOCK_M == 64 else [232, 32],
            )


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


# Each consumer warpgroup's dQ share per step: [64 query rows, 64 columns] of fp32.
DQ_BOX = (64, 64)


@functools.cache
def _dq_layout():
    """The shared-memory layout of a dQ share and of its TMA reduce (cached: ~20 us to build)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


def dq_accumulator(q, zeroed: bool = True, width: int | None = None):
    """The fp32 dQ accumulator, shaped like q but `width` columns a head (default q's d) and
    contiguous, with storage for at least one whole TMA box of rows behind it; zero-filled when
    `zeroed`, else left for the backward's preprocess to zero (`_flash_bwd`, `ZERO_DQ`: it does
    so where every row belongs to a sequence, in its first d columns; the rows behind q's are
    never read).

    The sm_90 backward takes `width=tile_width(d)`: at d = 80 and 96 its 128-wide dQ shares
    add garbage (from the K tile's columns past d) into columns d.. of each head, which must
    be that head's own padding, never the next head's; only `[..., :d]` is read
    (`_flash_bwd._scaled_dq`).

    Its TMA grid (`tma_view`) is at least one box of rows however short q is: TMA clips its
    writes only at the grid's end, so a reduce into a shorter buffer would add (zeros) past its
    end, and x + 0.0 is not bitwise x for -0.0 or a NaN payload.
    """
    shape = (*q.shape[:-1], q.shape[-1] if width is None else width)
    numel = math.prod(shape)
    row_elems = shape[-1] * shape[-2]
    rows = numel // row_elems if row_elems else 0
    new = zeros if zeroed else empty
    if rows >= DQ_BOX[0]:
        return new(shape, torch.float32, q.device)
    storage = new((DQ_BOX[0] * row_elems,), torch.float32, q.device)
    return storage[:numel].view(shape)


def plan_views(q, k, v, dout, varlen: bool):
    """The TMA grids of q, k, v and dout, or None when any of them cannot take this path (a
    pair outside `SUPPORTED_DIMS`, storage TMA cannot read, fewer rows than one box: `tma_view`,
    or rows narrower than the tile's box)."""
    d, d_v = q.shape[-1], v.shape[-1]
    if (d, d_v) not in SUPPORTED_DIMS:
        return None
    width, width_v = widths(d, d_v)
    block_m = TILES[width][0]
    keys = block_n(d)
    views = (
        tma_view(q, varlen, block_m),
        tma_view(k, varlen, keys),
        tma_view(v, varlen, keys),
        tma_view(dout, varlen, block_m),
    )
    if any(view is None for view in views):
        return None
    # A box wider than the grid's rows (one head of d = 80, 96, 160 or 192 in rows of d elements)
    # is no legal TMA box; such rows take the portable kernels.
    if any(view[0][1] < w for view, w in zip(views, (width, width, width_v, width_v))):
        return None
    return views


def backward_sm90(
    q, k, v, dout, lse, delta, dq_acc, dk, dv, geom, *, softmax_scale, causal, bottom_right,
    signature=None,
):  # fmt: skip
    """Launch `_attn_bwd_sm90` on input TMA can read in place (`plan_views` says so:
    `dispatch.sm90_backward_plan`): writes dk / dv (any strides with stride(-1) == 1;
    rows past a sequence's end are left alone) and adds the unscaled dQ into `dq_acc` (fp32,
    from `dq_accumulator` with `width=tile_width(d)`, zeroed; its columns past d take
    garbage). `lse`, `delta`: contiguous fp32 as the portable backward has them (delta with any
    LSE gradient already folded in). `signature`: the backward's launch signature
    (`_flash_bwd`); with it everything but the TMA descriptors' tensors and the pointers is
    planned once per signature (`_launch_plan`) and the launch goes straight to the compiled
    kernel after the first."""
    plan = planned(
        _PLANS, signature, (bool(causal), bool(bottom_right), _settings(q.shape[-1], v.shape[-1])),
        lambda: _launch_plan(
            q, k, v, dout, lse, dq_acc, dk, dv, geom, causal, bottom_right, signature
        ),
    )  # fmt: skip
    if plan.grid[0] == 0:
        return
    q_desc, k_desc, v_desc, do_desc, dq_desc = plan.descriptors
    args = (
        q_desc(q), k_desc(k), v_desc(v), do_desc(dout), dq_desc(dq_acc), lse, delta, dk, dv,
        geom.q.cu_seqlens, geom.q.seq_offsets, geom.q.seqlens,
        geom.k.cu_seqlens, geom.k.seq_offsets, geom.k.seqlens,
        *plan.ints, float(softmax_scale) * LOG2E, float(softmax_scale), plan.order_pairs,
    )  # fmt: skip
    if not launch_bound(plan.slot, args):  # the constexprs' keywords only for the first launch
        launch(_attn_bwd_sm90, plan.grid, *args, **plan.constexprs, signature=plan.signature,
               slot=plan.slot)  # fmt: skip


class _LaunchPlan(NamedTuple):
    """What a launch of `_attn_bwd_sm90` derives from the call's signature (`_launch_plan`)."""

    grid: tuple[int]
    descriptors: tuple  # makers of q's, k's, v's, dO's and dQ's TMA descriptors
    ints: tuple  # strides of q, k, v, dO, LSE, dQ, dK, dV; heads, group, lengths
    order_pairs: int
    constexprs: dict
    signature: tuple | None
    slot: dict | None


# Plans by (signature, causal, bottom_right, module settings) (`planned`).
_PLANS: dict[tuple, _LaunchPlan] = {}


def _settings(d: int, d_v: int) -> tuple:
    """The module settings a plan for head dims (d, d_v) reads (the A/B scripts flip them in one
    process; the tables are per tile width, `WIDE_DEFAULTS` per dims)."""
    width = tile_width(d)
    return (
        TILES[width], DQ_BEFORE_DK[width], DQ_WAIT_LATE[width], P_FROM_REGISTERS[width],
        _common.CAUSAL_ORDER_L2_BYTES, WIDE_DEFAULTS.get((d, d_v)),
    )  # fmt: skip


def _launch_plan(
    q, k, v, dout, lse, dq_acc, dk, dv, geom, causal, bottom_right, signature
) -> _LaunchPlan:  # fmt: skip
    """Grid, dQ grid, runtime integers and constexprs of the launch: from shapes, strides,
    dtypes and devices only, so one plan serves every call of a signature."""
    d, d_v = q.shape[-1], v.shape[-1]
    width, width_v = widths(d, d_v)
    block_m, stages = TILES[width]
    keys = block_n(d)
    sq, sk, sv, sdo = (strides4(t, geom.varlen) for t in (q, k, v, dout))
    sdq, sdk, sdv = (strides4(t, geom.varlen) for t in (dq_acc, dk, dv))
    h_q, h_kv = q.shape[-2], k.shape[-2]
    grid = (cdiv(geom.k.max_len, keys) * geom.batch * h_kv,)
    ints = (
        *sq[:3], *sk[:3], *sv[:3], *sdo[:3], *lse_strides(lse, geom.varlen),
        *sdq[:3], *sdk[:3], *sdv[:3],
        h_kv, h_q // h_kv, geom.q.max_len, geom.k.max_len,
    )  # fmt: skip
    # A (sequence, KV head) pair streams its group's q and dO rows.
    order_pairs = causal_order_heads(
        geom.q.max_len, head_row_bytes(q, dout) * (h_q // h_kv), 1, geom.batch * h_kv
    )
    constexprs = dict(
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=keys, NUM_STAGES=stages,
        SEQ_MODE_Q=geom.q.mode, SEQ_MODE_K=geom.k.mode, IS_CAUSAL=bool(causal),
        BOTTOM_RIGHT=bool(bottom_right), DQ_FIRST=DQ_BEFORE_DK[width],
        WAIT_LATE=DQ_WAIT_LATE[width], P_IN_REGS=P_FROM_REGISTERS[width], HEAD_DIM_V=d_v,
        DO_STAGES=stages, DV_EARLY=False, num_warps=CONSUMER_WARPS, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    constexprs.update(wide_settings(d, d_v))  # the wide schedule's variants at these dims
    views = plan_views(q, k, v, dout, geom.varlen)
    if views is None:  # `dispatch.sm90_backward_plan` sends these elsewhere
        raise ValueError(
            f"sm_90 backward: TMA cannot read q {q.stride()}, k {k.stride()}, v {v.stride()} "
            f"or dout {dout.stride()} in place"
        )
    descriptors = tuple(
        descriptor_maker(t, view, [rows, w])
        for t, view, rows, w in zip(
            (q, k, v, dout), views, (block_m, keys, keys, block_m),
            (width, width, width_v, width_v),
        )
    )  # fmt: skip
    if dq_acc.shape[-1] != width:  # `dq_accumulator(q, width=tile_width(d))`
        raise ValueError(
            f"sm_90 backward: the dQ accumulator's rows are {dq_acc.shape[-1]} wide, not the "
            f"tiles' {width}"
        )
    dq_view = tma_view(dq_acc, geom.varlen, DQ_BOX[0], storage_rows=DQ_BOX[0])
    descriptors += (descriptor_maker(dq_acc, dq_view, list(dq_box(d)), _dq_layout()),)
    signature, slot = launch_binding(signature, order_pairs)
    return _LaunchPlan(grid, descriptors, ints, order_pairs, constexprs, signature, slot)


__all__ = [
    "GLUON_AVAILABLE", "SUPPORTED_DIMS", "WIDE_DEFAULTS", "WIDE_VARIANTS", "backward_sm90",
    "block_n", "dq_accumulator", "dq_box", "plan_views", "tile_width", "wide_settings",
    "wide_variant_fits", "widths",
]  # fmt: skip
