"""Split-KV ("flash-decoding") attention forward for few queries over a long KV cache.

Inference only (no backward). Shapes:
    q        [b, s_q, h_q, d]                 (s_q small: 1 .. ~16 new tokens)
    k/v      contiguous cache [b_cache, s_cache, h_kv, d], or
             paged cache [num_blocks, page_size, h_kv, d] + block_table int32 [b, max_blocks]
    seqlens_k int32 [b]: keys of sequence z are cache rows [leftpad[z], seqlens_k[z])
    -> out [b, s_q, h_q, d] (q's dtype), lse [b, h_q, s_q] (fp32, natural log)
Every tensor arrives with its own strides (last dim contiguous).

Work split: one program per (sequence z, KV head, query-row block, split). The query rows of one
program are the s_q queries times the `group = h_q // h_kv` query heads that read this KV head,
packed into one [BLOCK_M, d] tile (row r = query i * group + head g), so each K/V tile is read
once per KV head, not once per query head. The visible key range of the tile is cut into
`num_splits` equal runs of key blocks, one per program; each program writes its rows' partial
output (normalized by its own softmax sum) and partial LSE in fp32, and the splits are merged by
LSE: with `FUSED_COMBINE`, where one program can load all of a tile's partials at once
(`_fuses_merge`), by the tile's last split program to finish, in the same launch; else by a
second launch, `_decode_combine`. With one split the main kernel writes the final output
directly (one launch either way).

The merge (both ways), the buffers kept per device (the fused merge's ticket counters, the
scratch for partials and an unreturned lse) and their stream assumption (`ORDERED_STREAMS`):
see `_decode_merge`.

Positions: key j is cache row j of its sequence (paged: row j % page_size of page
block_table[z, j // page_size]); query i sits at position seqlens_k - s_q + i (bottom-right
alignment), so the window and ALiBi rules are those of `_common` with diag = seqlens_k - s_q.
Keys before leftpad[z] are invisible; since windows and ALiBi depend only on j - i, a left pad
needs no other change.

Paged caches: a key block never straddles two pages, so page_size must be a multiple of the key
block; the launcher picks BLOCK_N among the powers of two dividing page_size, hence page_size must
be a positive multiple of 16 (tl.dot's minimum width), see `check_page_size`. With
`PAGE_PREFETCH` (the default) each block's page is read from the block table a block ahead and
once per page, so that no K/V load waits on a table load.

Rows with no visible key get output 0 and LSE -inf. Statistics and accumulation are fp32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# The merge's host-side names (`_ticket_counters`, `_fuses_merge`, `_decode_combine`) are read
# through the module, so a test or tool that replaces one replaces it there, for every caller.
from . import _compat, _decode_merge
from ._common import (
    LN2,
    MAX_PLANS,
    cdiv,
    diagonal_offset,
    empty,
    key_block_range,
    load_tile,
    multiprocessors,
    next_pow2,
    next_pow2_dim,
    remember,
    scores_log2,
    smem_per_block,
    visible_tile,
)
from ._decode_merge import _combine_tile, _last_split_done, _store_rows
from ._launch import call_signature, config_slot, launch, launch_bound, launch_slot

# --------------------------------------------------------------------------------------------------
# Launch geometry
# --------------------------------------------------------------------------------------------------

PAGE_MULTIPLE = 16  # page sizes must be multiples of this (the smallest key block)
MAX_BLOCK_M = 64  # query rows (s_q * group) per program at most; more rows take more programs
MAX_SPLITS = 64
# Key blocks per split at least, in units of `_NOMINAL_BLOCK_N` keys: a split shorter than this
# spends more on its partial write and the combine than it saves.
_MIN_BLOCKS_PER_SPLIT = 2
_NOMINAL_BLOCK_N = 64

# (BLOCK_N, num_warps, num_stages) candidates on the GPU. A first choice for a streaming kernel
# (K/V tiles of 8..32 KiB, deep pipelines), to be measured with examples/benchmark_decode.py.
_CANDIDATES = [
    (64, 4, 3),
    (64, 4, 4),
    (128, 4, 3),
    (128, 8, 3),
    (64, 8, 4),
    # Fallbacks for page sizes 16 and 32 (any multiple of 16 that 64 does not divide).
    (32, 4, 4),
    (16, 4, 4),
]
_INTERPRET_CONFIG = (16, 4, 1)


# Split calls merge their splits in the main launch (its last program per tile) when True and
# the merge fits one load (`_fuses_merge`), else in a second launch. Read per call, so one
# process can time both (examples/perf/decode_splits.py --combine). On the H100 (graph
# replays, GQA 32:8, d = 128, the heuristic's split count) the fused merge read 0.9-1.2 us
# faster per call at b = 1 and 8 with 1k-32k keys (11.5 against 12.4 us at b = 1, 1k keys);
# a merge stepping through rows or splits in one program read ~8 us slower at b = 1, 8k keys,
# 33 splits (docs/performance.md, "The split merge in the decode kernel").
FUSED_COMBINE = True

# Decode calls on one device run in stream order (one stream, or streams ordered by events), so
# they may share the per-device ticket counters and scratch `_decode_merge` keeps. False: each
# call allocates its own partials and lse and merges in a second launch (for calls on unordered
# streams). Read per call.
ORDERED_STREAMS = True

# Paged caches: each key block's page (its block-table entry) is loaded a block ahead, a value
# the loop carries, and only where the next block starts a page (`_next_page`), when True; else
# just before the block's K load (and again for V), which waits on it. Read when a call's plan
# is made (plans are kept per setting), so one process can time both. Why: the paged cache read
# 5-11% slower than the contiguous one on the H100 at b = 1 with 8k-32k keys (GQA 32:8, d = 128,
# pages of 256 rows, shuffled). Compiled offline for sm_90 (Triton 3.9, BLOCK_N 64, 4 warps,
# 3 stages, bf16), the pipeliner copies the table entry ahead (cp.async) but then gives K and V
# one buffer each, issued after the block's dots and waited for (all copies) at the next
# block's start, so no K/V load overlaps the dots; a block ahead, K and V get two buffers each
# and a wait that leaves two copy groups in flight, as for the contiguous cache (every
# candidate config alike). Measured on the H100 (graph replays, b = 1, 8k keys): one split
# 139.8 -> 97.0 us (contiguous 95.4), 16 splits 28.2 -> 24.9 (contiguous 24.8)
# (docs/performance.md, "Paged decode: pages read a block ahead").
PAGE_PREFETCH = True


def check_page_size(page_size: int) -> None:
    """Raise ValueError unless the decode kernel can take pages of `page_size` rows."""
    if page_size <= 0 or page_size % PAGE_MULTIPLE:
        raise ValueError(
            f"page size {page_size} (k_cache.shape[1] with a block_table) must be a positive "
            f"multiple of {PAGE_MULTIPLE}: a key block of the decode kernel never spans two pages"
        )


# Cached: decode calls repeat a handful of (tiles, capacity) pairs.
@functools.lru_cache(maxsize=4096)
def num_splits_heuristic(tiles: int, max_len_k: int, device: torch.device) -> int:
    """Splits per (sequence, KV head, row block) for `tiles` such programs over up to
    `max_len_k` keys (the cache's capacity: the lengths stay on the device).

    One wave: as many splits as keep every program on a multiprocessor of its own, contiguous
    and paged caches alike. Measured on the H100 (docs/performance.md, "Decode split counts"):
    at b = 1 with 8 KV heads, 16 splits (128 programs) beat 33 (two waves) by 3-6% from 8k to
    128k keys, and 24 (a ragged second wave) was slowest; with more tiles than multiprocessors
    one split is fastest or within 3%. Paged caches took two waves until their key blocks'
    pages were read a block ahead (`PAGE_PREFETCH`); since then 16 splits read as fast on them
    as on the contiguous cache ("Paged decode: pages read a block ahead").

    No split gets fewer than `_MIN_BLOCKS_PER_SPLIT` key blocks: a shorter one costs more in
    its partial write and the combine than it saves.
    """
    sms = multiprocessors(device)
    tiles = max(tiles, 1)
    key_blocks = cdiv(max(max_len_k, 1), _NOMINAL_BLOCK_N)
    cap = max(1, min(key_blocks // _MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))
    return max(1, min(sms // tiles, cap))


def _configs() -> list[triton.Config]:
    cands = [_INTERPRET_CONFIG] if _compat.INTERPRETER else _CANDIDATES
    return [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s) for bn, w, s in sorted(cands)]


def _prune_configs(configs, named_args, **kwargs):
    """Key blocks that never straddle a page, and K/V pipelines that fit in shared memory."""
    if _compat.INTERPRETER:
        return configs
    args = {**named_args, **kwargs}
    page_size, paged, block_d = args["page_size"], args["PAGED"], args["BLOCK_D"]
    elem = args["q_ptr"].element_size()
    # K and V tiles multi-buffered by the pipeliner; 16 KiB left for Q and the layout shuffles.
    smem = smem_per_block(args["q_ptr"].device) - 16 * 1024
    fits = [
        c
        for c in configs
        if (not paged or page_size % c.kwargs["BLOCK_N"] == 0)
        and c.num_stages * c.kwargs["BLOCK_N"] * 2 * block_d * elem <= smem
    ]
    wide = [c for c in fits if c.kwargs["BLOCK_N"] >= 64]
    if wide:
        return wide
    # Pages of 16 or 32 rows (or an fp32 d = 256 tile): the widest block that fits.
    widest = max(c.kwargs["BLOCK_N"] for c in fits) if fits else 16
    return [c for c in (fits or configs) if c.kwargs["BLOCK_N"] == widest][:2]


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _first_page(table_row_ptr, s_lo, s_hi, page_size):
    """The page of a split's first key block (at s_lo), or 0 for an empty split (s_lo >= s_hi),
    which may start past the end of the table row."""
    return tl.load(table_row_ptr + s_lo // page_size, mask=s_lo < s_hi, other=0)


@triton.jit
def _next_page(table_row_ptr, next_n, s_hi, page, page_size):
    """The page of the key block at `next_n`, given `page`, that of the block before it.

    A block never straddles a page, so the table is read only where `next_n` starts one (one
    load in page_size / BLOCK_N blocks), and never at or past the split's end `s_hi`: the loop
    asks one block ahead, and the row may end there.
    """
    fresh = (next_n < s_hi) & (next_n % page_size == 0)
    return tl.load(table_row_ptr + next_n // page_size, mask=fresh, other=page)


@triton.jit
def _kv_block_origin(start_n, page, z_cache, table_row_ptr, page_size, stride_b, stride_s,
                     PAGED: tl.constexpr, PAGE_PREFETCH: tl.constexpr):  # fmt: skip
    """int64 element offset of key row `start_n` (a block origin) in one cache operand.

    Paged: row start_n % page_size of page table_row[start_n // page_size], which is `page`
    when PAGE_PREFETCH (loaded an iteration earlier by the caller), else loaded here; the
    caller's blocks never straddle pages. Contiguous: row start_n of cache entry z_cache.
    """
    if PAGED:
        if not PAGE_PREFETCH:
            page = tl.load(table_row_ptr + start_n // page_size)
        origin = page.to(tl.int64) * stride_b + (start_n % page_size).to(tl.int64) * stride_s
    else:
        origin = z_cache * stride_b + tl.cast(start_n, tl.int64) * stride_s
    return origin


@triton.jit
def _split_range(lo, hi, split, num_splits, BLOCK_N: tl.constexpr):
    """This split's share [s_lo, s_hi) of the key blocks in [lo, hi) (lo a block multiple)."""
    n_blocks = tl.maximum(tl.cdiv(hi - lo, BLOCK_N), 0)
    per_split = tl.cdiv(n_blocks, num_splits)
    s_lo = lo + split * per_split * BLOCK_N
    s_hi = tl.minimum(hi, s_lo + per_split * BLOCK_N)
    return s_lo, s_hi


@triton.jit
def _decode_fwd(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, ticket_ptr,
    seqlens_ptr, batch_idx_ptr, leftpad_ptr, table_ptr, alibi_ptr,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    stride_pb, stride_ps, stride_ph, stride_pp,
    stride_qpb, stride_qps, stride_qph,
    stride_tb, stride_ab, stride_ah,
    len_q, group, num_heads_kv, num_m, num_splits, page_size, CACHE_BUCKET,
    sm_scale, softcap, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, BLOCK_S: tl.constexpr, COMBINE_ROWS: tl.constexpr,
    PAGE_PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M packed query rows of (sequence z, KV head) over one split's keys.

    Grid (b * h_kv * num_m, num_splits). SPLIT: write normalized partial rows and LSEs to
    o_part [b, s_q, h_q, splits, BLOCK_D] / lse_part [b, s_q, h_q, splits] (strides p*, qp*);
    else the final out and lse. FUSED_COMBINE (with SPLIT): the program that finishes its tile
    last also merges the tile's partials into out and lse (`_combine_tile`), counting finished
    splits in ticket int32 [>= b * h_kv * num_m] (one counter per tile, zero between calls);
    BLOCK_S = next_pow2(num_splits), COMBINE_ROWS = next_pow2(rows of a tile) its load shape.
    Otherwise ticket_ptr and those two are unused. PAGE_PREFETCH (with PAGED): each key block's
    page is loaded a block ahead (the module's `PAGE_PREFETCH`). CACHE_BUCKET only keys the
    autotuner.
    """
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    m_blk = pid % num_m
    zh = pid // num_m
    h_kv = zh % num_heads_kv
    z = zh // num_heads_kv
    len_k = tl.load(seqlens_ptr + z)
    diag = diagonal_offset(len_q, len_k, True)

    # Packed rows: r = i * group + g is query i of query head h_kv * group + g.
    n_rows = len_q * group
    offs_r = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < n_rows
    qi = offs_r // group
    h = h_kv * group + offs_r % group
    offs_d = tl.arange(0, BLOCK_D)
    dim_ok = offs_d < HEAD_DIM

    # Keys any row of the tile may see: the first row's lower bound, the last row's upper one.
    first_i = (m_blk * BLOCK_M) // group
    last_i = (tl.minimum(m_blk * BLOCK_M + BLOCK_M, n_rows) - 1) // group
    lo, _, _, _ = key_block_range(
        first_i, diag, window_left, window_right, len_k, 1, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    _, _, _, hi = key_block_range(
        last_i, diag, window_left, window_right, len_k, 1, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    key_lo = len_k * 0
    if HAS_LEFTPAD:
        key_lo = tl.load(leftpad_ptr + z)
        lo = tl.maximum(lo, (key_lo // BLOCK_N) * BLOCK_N)
    s_lo, s_hi = _split_range(lo, hi, split, num_splits, BLOCK_N)

    z64 = z.to(tl.int64)
    q_rows = z64 * stride_qb + qi.to(tl.int64) * stride_qs + h.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0)  # fmt: skip
    alibi_slope = sm_scale  # a placeholder, unused unless HAS_ALIBI
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + z * stride_ab + h * stride_ah, mask=row_ok, other=0.0)
        alibi_slope = slopes.to(tl.float32)[:, None]

    z_cache = z64
    if HAS_BATCH_IDX:
        z_cache = tl.load(batch_idx_ptr + z).to(tl.int64)
    table_row = table_ptr + z64 * stride_tb
    k_head = k_ptr + h_kv.to(tl.int64) * stride_kh
    v_head = v_ptr + h_kv.to(tl.int64) * stride_vh

    offs_nb = tl.arange(0, BLOCK_N)
    qi_tile = qi[:, None]  # query-major index tiles (`_common` legend)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # PAGED and PAGE_PREFETCH: the next key block's page, loaded a block ahead (a loop-carried
    # value), so no K/V load waits on a table load issued just before it.
    next_page = 0
    if PAGED and PAGE_PREFETCH:
        next_page = _first_page(table_row, s_lo, s_hi, page_size)
    for start_n in range(s_lo, s_hi, BLOCK_N):
        page = next_page
        if PAGED and PAGE_PREFETCH:
            next_page = _next_page(table_row, start_n + BLOCK_N, s_hi, page, page_size)
        offs_n = start_n + offs_nb
        kj = offs_n[None, :]
        # Rows past the sequence or before its left pad may hold anything (NaN in a poisoned
        # cache): they load as 0, so p = 0 times them stays 0.
        key_ok = (offs_n < len_k) & (offs_n >= key_lo)
        k_org = _kv_block_origin(start_n, page, z_cache, table_row, page_size, stride_kb,
                                 stride_ks, PAGED, PAGE_PREFETCH)  # fmt: skip
        k_ptrs = k_head + k_org + offs_nb[:, None] * stride_ks + offs_d[None, :]
        k = load_tile(k_ptrs, key_ok, dim_ok, True, HEAD_DIM != BLOCK_D, 0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = scores_log2(
            qk, sm_scale, softcap, qk, alibi_slope, qi_tile, kj, diag,
            HAS_SOFTCAP, False, HAS_ALIBI,
        )  # fmt: skip
        visible = visible_tile(
            qi_tile, kj, diag, window_left, window_right, len_q, len_k,
            HAS_LEFT, HAS_RIGHT, True, False,
        )  # fmt: skip
        visible = visible & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Nothing visible yet: shift by 0 so exp2 gives 0, not NaN. m_i keeps the true max (-inf)
        # so a later block is never measured against a made-up 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_org = _kv_block_origin(start_n, page, z_cache, table_row, page_size, stride_vb,
                                 stride_vs, PAGED, PAGE_PREFETCH)  # fmt: skip
        v_ptrs = v_head + v_org + offs_nb[:, None] * stride_vs + offs_d[None, :]
        v = load_tile(v_ptrs, key_ok, dim_ok, True, HEAD_DIM != BLOCK_D, 0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # Normalize this split's rows; rows with no visible key: output 0, LSE -inf.
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc * tl.where(has_keys, 1.0 / l_safe, 0.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    qi64, h64 = qi.to(tl.int64), h.to(tl.int64)
    if SPLIT:
        part = z64 * stride_pb + qi64 * stride_ps + h64 * stride_ph + split * stride_pp
        tl.store(o_part_ptr + part[:, None] + offs_d[None, :], out, mask=row_ok[:, None])
        part_l = z64 * stride_qpb + qi64 * stride_qps + h64 * stride_qph + split
        tl.store(lse_part_ptr + part_l, lse, mask=row_ok)
        if FUSED_COMBINE:
            # Every split program of the tile, empty or not, takes exactly one ticket: the one
            # that draws num_splits - 1 knows all the tile's partials are stored.
            if _last_split_done(ticket_ptr + pid, num_splits):
                _combine_tile(
                    out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, z64, h_kv, m_blk * BLOCK_M,
                    tl.minimum(m_blk * BLOCK_M + BLOCK_M, n_rows), group, num_splits,
                    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
                    stride_pb, stride_ps, stride_ph, stride_pp, stride_qpb, stride_qps,
                    stride_qph, HEAD_DIM, BLOCK_D, BLOCK_S, COMBINE_ROWS,
                )  # fmt: skip
                # Every split of this tile has counted itself, so nothing in this launch reads
                # the counter again; the next launch on the stream (or graph replay) starts
                # after this store, so it finds 0 without a memset.
                tl.store(ticket_ptr + pid, 0)
    else:
        _store_rows(out_ptr, lse_ptr, z64, qi64, h64, row_ok, dim_ok, offs_d, out, lse,
                    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls)  # fmt: skip


_decode_fwd_tuned = triton.autotune(
    configs=_configs(),
    key=["HEAD_DIM", "BLOCK_M", "PAGED", "page_size", "SPLIT", "FUSED_COMBINE", "PAGE_PREFETCH"]
    + ["num_splits", "CACHE_BUCKET"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_decode_fwd)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------


class DecodePlan(NamedTuple):
    """What `decode_attention`'s launches derive from a call's signature (shapes, strides,
    dtypes, devices of every input, the scalar arguments, `MAX_BLOCK_M` and `PAGE_PREFETCH`),
    made once per signature and settings by `_make_plan`. Per call there is left: out's
    allocation, lse's where the caller returns it (the partials and an unreturned lse live in
    the device's scratch, `_decode_merge._scratch`) and the launches; the main launch's
    constexprs, tuning key and slot come in two versions for a split call, the separate
    combine's (`constexprs`, ...) and the fused one's (`fused_constexprs`, ...), picked per call
    by `FUSED_COMBINE`."""

    out_shape: tuple[int, ...]
    lse_shape: tuple[int, ...]
    num_splits: int  # after the heuristic (`num_splits_heuristic`) and the caps
    workspace: int  # fp32 elements of the split partials: o_part, then lse_part (0: no split)
    lse_part_at: int  # where lse_part starts in the workspace
    lse_at: int  # where an unreturned lse starts in the scratch: after the partials, 64-B aligned
    lse_numel: int
    grid: tuple[int, int]  # (tiles, num_splits): the fused merge takes one counter per tile
    ints: tuple  # the main launch's arguments after its tensors
    constexprs: dict  # no split, or split with the separate combine launch
    tuning: tuple  # the key of the autotuner's pick in `_PICKED`
    combine_grid: tuple[int]
    combine_ints: tuple  # the combine pass's arguments after its tensors
    combine_kwargs: dict
    slot: dict  # `_launch.launch_slot` of the main launch (per autotuner pick)
    combine_slot: dict
    # split with the merge in the main launch (None: no split, or a merge too large to fuse)
    fused_constexprs: dict | None
    fused_tuning: tuple | None
    fused_slot: dict | None


# Plans by (signature, MAX_BLOCK_M, PAGE_PREFETCH); bounded by `remember`.
_PLANS: dict[tuple, DecodePlan] = {}


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = True,
    signature: tuple | None = None,
    shared_buffers: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split-KV attention of q over a KV cache, on validated input; returns (out, lse).

    q [b, s_q, h_q, d]; k_cache/v_cache [b_cache, s_cache, h_kv, d] or, with block_table
    (int32 [b, max_blocks], every entry a sequence uses in [0, num_blocks)), paged
    [num_blocks, page_size, h_kv, d] with page_size a multiple of 16; any strides with
    stride(-1) == 1. seqlens_k int32 [b]: keys of sequence z are rows [leftpad_z, seqlens_k[z])
    (within the cache's capacity). cache_batch_idx int32 [b]: the cache entry of sequence z
    (contiguous caches). cache_leftpad int32 [b]: first visible key per sequence.
    window: bottom-right aligned, -1 = unbounded (causal is right = 0). alibi_slopes fp32 [b, h_q]
    view (stride_b may be 0). num_splits: 0 = heuristic, 1 = no combine pass.
    Returns out [b, s_q, h_q, d] in q's dtype and lse fp32 [b, h_q, s_q] (None with
    `return_lse=False`: it is then written to scratch, one allocation fewer). No host sync.
    Everything the launches derive from the call's signature is planned once (`DecodePlan`).
    `signature`: a caller that has keyed its own inputs already passes that key, which must
    determine every argument's shape, strides, dtype, device and 16-byte alignment and every
    scalar here (`flash_attn_with_kvcache` does); else it is `call_signature` of the arguments.
    A split call is one launch with `FUSED_COMBINE` (see `_decode_merge` for its stream
    assumption), else two. `shared_buffers=False`: the call allocates its own partials and lse
    and merges in a second launch, as with `ORDERED_STREAMS = False`; the custom op of
    `decode_ops.py` does, because inside torch.compile's CUDA graphs a device buffer this module
    keeps would be allocated from the graph's memory pool, which then fails its check that
    every live allocation is one of the graph's outputs.
    """
    if _compat.upcast_bf16(q.dtype):  # the interpreter's bf16 dot is wrong: compute in fp32
        out, lse = decode_attention(
            q.float(), k_cache.float(), v_cache.float(), seqlens_k, block_table=block_table,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
            softmax_scale=softmax_scale, window_left=window_left, window_right=window_right,
            softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits,
            return_lse=return_lse, shared_buffers=shared_buffers,
        )  # fmt: skip
        return out.to(q.dtype), lse
    # The kernel indexes these with unit strides; copies only when a caller passed strided views.
    q = q if q.stride(-1) == 1 else q.contiguous()
    seqlens_k, cache_batch_idx, cache_leftpad, block_table = (
        t if t is None else t.contiguous()
        for t in (seqlens_k, cache_batch_idx, cache_leftpad, block_table)
    )
    if signature is None:
        # What both launches specialize on (`_launch.call_signature`); the partials follow.
        signature = call_signature(
            (q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
             alibi_slopes),
            (softmax_scale, softcap, window_left, window_right, num_splits),
        )  # fmt: skip
    key = (signature, MAX_BLOCK_M, PAGE_PREFETCH)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(
            q, k_cache, v_cache, seqlens_k, block_table, cache_batch_idx, cache_leftpad,
            alibi_slopes, softmax_scale=softmax_scale, window_left=window_left,
            window_right=window_right, softcap=softcap, num_splits=num_splits,
        )  # fmt: skip
        remember(_PLANS, key, plan, MAX_PLANS)
    out = empty(plan.out_shape, q.dtype, q.device)
    if out.numel() == 0:
        lse = torch.full(plan.lse_shape, float("-inf"), device=q.device) if return_lse else None
        return out, lse
    # The partials and an unreturned lse share one fp32 buffer: the kernels take their pointers
    # and the plan's strides, so each needs only its start.
    views = None
    scratch_size = plan.workspace if return_lse else plan.lse_at + plan.lse_numel
    starts = (0, plan.lse_part_at, plan.lse_at)
    shared_buffers = shared_buffers and ORDERED_STREAMS
    if scratch_size:
        if shared_buffers:
            views = _decode_merge._scratch_views(q.device, scratch_size, starts)
        if views is None:
            scratch = torch.empty(scratch_size, dtype=torch.float32, device=q.device)
            views = tuple(scratch[start:] for start in starts)
    if return_lse:
        lse = empty(plan.lse_shape, torch.float32, q.device)
    else:
        lse = views[2]
    if plan.workspace:
        o_part, lse_part = views[0], views[1]
    else:
        o_part = lse_part = lse  # unused placeholders
    dummy = seqlens_k
    tickets = None
    if plan.fused_constexprs is not None and FUSED_COMBINE and shared_buffers:
        # None: the separate merge this once
        tickets = _decode_merge._ticket_counters(q.device, plan.grid[0])
    args = (
        q, k_cache, v_cache, out, lse, o_part, lse_part,
        tickets if tickets is not None else dummy, seqlens_k,
        cache_batch_idx if cache_batch_idx is not None else dummy,
        cache_leftpad if cache_leftpad is not None else dummy,
        block_table if block_table is not None else dummy,
        alibi_slopes if alibi_slopes is not None else dummy,
        *plan.ints,
    )  # fmt: skip
    # The resolved split count joins the signature: a runtime int the launches specialize on.
    signature = (signature, plan.num_splits)
    if tickets is not None:
        _launch(plan.grid, args, plan.fused_constexprs, signature, plan.fused_tuning,
                plan.fused_slot)  # fmt: skip
        return out, lse if return_lse else None
    _launch(plan.grid, args, plan.constexprs, signature, plan.tuning, plan.slot)
    if plan.workspace:
        launch(_decode_merge._decode_combine, plan.combine_grid,
            out, lse, o_part, lse_part, *plan.combine_ints,
            **plan.combine_kwargs, signature=signature, slot=plan.combine_slot,
        )  # fmt: skip
    return out, lse if return_lse else None


def _make_plan(
    q, k_cache, v_cache, seqlens_k, block_table, cache_batch_idx, cache_leftpad, alibi_slopes, *,
    softmax_scale, window_left, window_right, softcap, num_splits,
) -> DecodePlan:  # fmt: skip
    """The decode launches' plan for this call's signature; reads shapes, strides, dtypes and
    devices only (the outputs and partials are stood in for by meta tensors)."""
    b, s_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    if paged:
        check_page_size(page_size)
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    out = torch.empty((b, s_q, h_q, d), device="meta")
    lse = torch.empty((b, h_q, s_q), device="meta")
    n_rows = s_q * group
    block_m = max(16, min(next_pow2(n_rows), MAX_BLOCK_M))
    num_m = cdiv(n_rows, block_m)
    tiles = b * h_kv * num_m
    if num_splits <= 0:
        num_splits = num_splits_heuristic(tiles, capacity, q.device)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS, cdiv(max(capacity, 1), PAGE_MULTIPLE)))
    block_d = next_pow2_dim(d)
    split = num_splits > 1
    workspace = lse_part_at = 0
    part_strides = (0,) * 7
    if split:
        o_part = torch.empty((b, s_q, h_q, num_splits, block_d), device="meta")
        lse_part = torch.empty((b, s_q, h_q, num_splits), device="meta")
        part_strides = (*o_part.stride()[:4], *lse_part.stride()[:3])
        # o_part's size is a multiple of block_d >= 16 elements: lse_part starts 64-byte aligned.
        lse_part_at = o_part.numel()
        workspace = lse_part_at + lse_part.numel()
    # 16 fp32 elements: the 64-byte alignment the allocator gives lse when the caller takes it
    # (launches are keyed on their inputs only, `call_signature`).
    lse_at = cdiv(workspace, 16) * 16
    alibi_strides = tuple(alibi_slopes.stride()) if alibi_slopes is not None else (0, 0)
    bucket = min(max(next_pow2(max(capacity, 1)), 1024), 131072)
    ints = (
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *out.stride()[:3], *lse.stride(), *part_strides,
        block_table.stride(0) if paged else 0, *alibi_strides,
        s_q, group, h_kv, num_m, num_splits, page_size, bucket,
        float(softmax_scale), float(softcap), int(window_left), int(window_right),
    )  # fmt: skip
    constexprs = dict(
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m,
        PAGED=paged, HAS_BATCH_IDX=cache_batch_idx is not None and not paged,
        HAS_LEFTPAD=cache_leftpad is not None,
        HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi_slopes is not None, SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FUSED_COMBINE=False, BLOCK_S=1, COMBINE_ROWS=1,
        PAGE_PREFETCH=paged and PAGE_PREFETCH,  # contiguous caches: one kernel either way
    )  # fmt: skip
    block_s = next_pow2(num_splits)
    fused_constexprs = None
    tile_rows = min(n_rows, block_m)
    if split and _decode_merge._fuses_merge(tile_rows, block_s, block_d):
        fused_constexprs = dict(constexprs, FUSED_COMBINE=True, BLOCK_S=block_s,
                                COMBINE_ROWS=next_pow2(tile_rows))  # fmt: skip
    # The autotuner's key, finer: every constexpr, the dtypes of the tensor arguments in order
    # (out has q's, lse and the partials fp32, the tickets int32 as seqlens_k, which stands in
    # for absent ones) and its runtime keys (page_size, num_splits, the cache bucket).
    dtypes = (q.dtype, k_cache.dtype, v_cache.dtype, q.dtype, torch.float32, torch.float32,
              torch.float32, *(t.dtype if t is not None else seqlens_k.dtype for t in
                               (seqlens_k, seqlens_k, cache_batch_idx, cache_leftpad,
                                block_table, alibi_slopes)))  # fmt: skip
    runtime_keys = (page_size, num_splits, bucket)
    return DecodePlan(
        out_shape=tuple(out.shape), lse_shape=tuple(lse.shape), num_splits=num_splits,
        workspace=workspace, lse_part_at=lse_part_at, lse_at=lse_at, lse_numel=lse.numel(),
        grid=(tiles, num_splits), ints=ints,
        constexprs=constexprs, tuning=(tuple(constexprs.values()), dtypes, runtime_keys),
        combine_grid=(b * s_q * h_q,),
        combine_ints=(*out.stride()[:3], *lse.stride(), *part_strides, s_q, h_q, num_splits),
        combine_kwargs=dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s,
                            num_warps=4 if block_s * block_d <= 4096 else 8),
        slot=launch_slot(), combine_slot=launch_slot(), fused_constexprs=fused_constexprs,
        fused_tuning=None if fused_constexprs is None else (
            tuple(fused_constexprs.values()), dtypes, runtime_keys),
        fused_slot=None if fused_constexprs is None else launch_slot(),
    )  # fmt: skip


# The autotuner's pick per tuning key, so later launches skip `Autotuner.run`'s host time
# (the pattern of `_flash_fwd._launch`).
_PICKED: dict[tuple, triton.Config] = {}


def _launch(
    grid, args, constexprs, signature: tuple | None, tuning: tuple, slot: dict | None = None
) -> None:
    config = _PICKED.get(tuning)
    if config is None:
        _decode_fwd_tuned[grid](*args, **constexprs)
        _PICKED[tuning] = _decode_fwd_tuned.best_config
    else:
        part = None if slot is None else config_slot(slot, config)
        if not launch_bound(part, args):
            launch(_decode_fwd, grid, *args, **constexprs, **config.all_kwargs(),
                   signature=signature, slot=part)  # fmt: skip
