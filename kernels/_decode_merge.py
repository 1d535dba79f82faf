"""The decode kernel's split merge (`_flash_decode`): a split call's partials into out and lse.

Each split program of `_flash_decode._decode_fwd` writes its rows' partial output (normalized by
its own softmax sum) and partial LSE in fp32; the merge weighs them by LSE: out = sum_s w_s o_s,
w_s = exp(lse_s - lse), lse = log sum_s exp(lse_s). Splits with LSE -inf weigh 0; all -inf gives
0 and -inf. With `_flash_decode.FUSED_COMBINE`, where one program can load all of a tile's
partials at once (`_fuses_merge`), the tile's last split program to finish merges them in the
same launch (`_last_split_done`, `_combine_tile`); else a second launch, `_decode_combine`, does,
one program per output row.

The fused merge: each split program, after its partial stores, takes a ticket from its tile's
int32 counter (an atomic add, acquire-release); the one drawing num_splits - 1 reads all the
tile's partials, writes out and lse, and sets the counter back to 0.

Buffers kept per device by this module: the counters (`_ticket_counters`, zeroed once) and a
scratch buffer (`_scratch`) for the split partials and for an lse the caller does not return.
A call then allocates only what it returns, and a CUDA graph replays with the buffers it
captured. Assumption (`_flash_decode.ORDERED_STREAMS`): decode calls on one device do not
overlap in time, i.e. they run on one stream or on streams ordered by events (as every decode
path of this library does: `flash_attn_with_kvcache`, `MultiheadAttention` decoding through
`InferenceParams`, `GPT.generate` and `DecodeGraph`, whose warm-up stream is joined both ways
and whose replays run on the caller's stream). Two calls running concurrently on unordered
streams would share counters and scratch; set `_flash_decode.ORDERED_STREAMS = False` for such
use: every call then allocates its own partials and lse and merges in a second launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, remember

# The fused merge loads [rows, splits, BLOCK_D] fp32 partials at once, at most this many
# elements (64 registers a thread at 4 warps); larger merges take the second launch.
_COMBINE_ELEMENTS = 8192
# Ticket counters per device: the smallest buffer made, so growing is rare (4 KiB).
_MIN_TICKETS = 1024


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _store_rows(out_ptr, lse_ptr, z64, qi64, h64, row_ok, dim_ok, offs_d, out, lse,
                stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls):  # fmt: skip
    """Final rows: out [R, BLOCK_D] (fp32, stored in out's dtype, the head dim's padding
    dropped) and lse [R] of query qi64 [R], head h64 [R] of sequence z64."""
    o_rows = z64 * stride_ob + qi64 * stride_os + h64 * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])  # fmt: skip
    tl.store(lse_ptr + z64 * stride_lb + h64 * stride_lh + qi64 * stride_ls, lse, mask=row_ok)


@triton.jit
def _last_split_done(ticket_ptr, num_splits):
    """Count this program's split as finished in its tile's counter; True in the program whose
    count completes the tile (ticket num_splits - 1), after which it may read every partial.

    Why the partials are visible to that program on the GPU: the barrier first orders every
    thread's partial stores before the one thread that runs the (scalar) atomic; the atomic's
    release half publishes them, cumulatively, at GPU scope. The adds on one counter form a
    single order, each reading the one before it, so the last ticket's acquire half
    synchronizes with every earlier split's release and orders all their stores before this
    thread's later loads; the barrier after it extends that to the program's other threads
    (Triton also broadcasts the scalar result through shared memory behind a barrier), and
    `_combine_tile` reads with `.cg` (from L2, never a stale line in the SM's L1) besides.
    Under the interpreter programs run one after another and the barriers do nothing.
    """
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    return ticket == num_splits - 1


@triton.jit
def _combine_tile(
    out_ptr, lse_ptr, o_part_ptr, lse_part_ptr, z64, h_kv, row_lo, row_hi, group, num_splits,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls,
    stride_pb, stride_ps, stride_ph, stride_pp, stride_qpb, stride_qps, stride_qph,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    COMBINE_ROWS: tl.constexpr,
):  # fmt: skip
    """`_decode_combine`'s merge for the packed rows [row_lo, row_hi) of one tile (sequence
    z64, KV head h_kv), in one program: out = sum_s w_s o_s, w_s = exp(lse_s - lse),
    lse = log sum_s exp(lse_s); splits with LSE -inf weigh 0, all -inf gives 0 and -inf.

    The tile's rows (at most COMBINE_ROWS) load their LSEs [rows, BLOCK_S] and partials
    [rows, BLOCK_S, BLOCK_D] together, one round trip to L2: the plan fuses the merge only where
    that load fits the register budget (`_fuses_merge`), since a program stepping through the
    rows or splits waits for L2 once per step, which measured slower than the second launch
    (docs/performance.md, "The split merge in the decode kernel").
    """
    offs_d = tl.arange(0, BLOCK_D)
    dim_ok = offs_d < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_S)
    rows = row_lo + tl.arange(0, COMBINE_ROWS)
    row_ok = rows < row_hi
    qi64 = (rows // group).to(tl.int64)
    h64 = (h_kv * group + rows % group).to(tl.int64)
    lse_rows = lse_part_ptr + z64 * stride_qpb + qi64 * stride_qps + h64 * stride_qph
    o_rows = o_part_ptr + z64 * stride_pb + qi64 * stride_ps + h64 * stride_ph
    s_ok = row_ok[:, None] & (offs_s < num_splits)[None, :]
    lse_s = tl.load(lse_rows[:, None] + offs_s[None, :], mask=s_ok, other=float("-inf"),
                    cache_modifier=".cg")  # fmt: skip
    m = tl.max(lse_s, 1)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    o = tl.load(
        o_rows[:, None, None] + offs_s[None, :, None] * stride_pp + offs_d[None, None, :],
        mask=s_ok[:, :, None], other=0.0, cache_modifier=".cg",
    )  # fmt: skip
    w = tl.exp(lse_s - m_shift[:, None])  # 0 for empty splits and padding
    total = tl.sum(w, 1)
    acc = tl.sum(o * w[:, :, None], 1)
    has_keys = total > 0.0
    t_safe = tl.where(has_keys, total, 1.0)
    out = tl.where(has_keys[:, None], acc / t_safe[:, None], 0.0)
    lse = tl.where(has_keys, m_shift + tl.log(t_safe), float("-inf"))
    _store_rows(out_ptr, lse_ptr, z64, qi64, h64, row_ok, dim_ok, offs_d, out, lse,
                stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ls)  # fmt: skip


@triton.jit
def _decode_combine(
    out_ptr, lse_ptr, o_part_ptr, lse_part_ptr,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    stride_pb, stride_ps, stride_ph, stride_pp,
    stride_qpb, stride_qps, stride_qph,
    len_q, num_heads_q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One program per output row (z, i, h): out = sum_s w_s o_s, w_s = exp(lse_s - lse),
    lse = log sum_s exp(lse_s). Splits with LSE -inf weigh 0; all -inf gives 0 and -inf."""
    pid = tl.program_id(0)
    h = pid % num_heads_q
    zi = pid // num_heads_q
    i = zi % len_q
    z = (zi // len_q).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < num_splits
    part_l = lse_part_ptr + z * stride_qpb + i * stride_qps + h * stride_qph
    lse_s = tl.load(part_l + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_shift)  # 0 for empty splits and padding
    total = tl.sum(w, 0)
    offs_d = tl.arange(0, BLOCK_D)
    part = o_part_ptr + z * stride_pb + i * stride_ps + h * stride_ph
    o = tl.load(part + offs_s[:, None] * stride_pp + offs_d[None, :], mask=s_ok[:, None],
                other=0.0)  # fmt: skip
    acc = tl.sum(o * w[:, None], 0)
    has_keys = total > 0.0
    t_safe = tl.where(has_keys, total, 1.0)
    out = tl.where(has_keys, acc / t_safe, 0.0)
    lse = tl.where(has_keys, m_shift + tl.log(t_safe), float("-inf"))
    o_row = out_ptr + z * stride_ob + i * stride_os + h * stride_oh
    tl.store(o_row + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(lse_ptr + z * stride_lb + h * stride_lh + i * stride_ls, lse)


# --------------------------------------------------------------------------------------------------
# Host side: the buffers kept per device, and the fusion rule
# --------------------------------------------------------------------------------------------------


# The fused merge's ticket counters: one zeroed int32 buffer per device, replaced by a larger one
# when a call has more tiles than it holds. Every launch leaves its counters at 0, so the buffer
# is zeroed once, when made, and never again. Replaced buffers are kept, never freed: a CUDA
# graph captured earlier still replays on the one it captured.
_TICKETS: dict[torch.device, torch.Tensor] = {}
_RETIRED_TICKETS: list[torch.Tensor] = []

# Scratch for what a call writes and no caller reads afterwards: the split partials, and the lse
# when the caller does not return it. One fp32 buffer per device, grown and kept like the
# counters; calls needing more than `_MAX_SCRATCH` elements (long multi-query chunks, where one
# allocation is small beside the work) allocate their own. Why: a CUDA allocation costs 4-6 us
# of the H100 host's time (torch.profiler; a timeit probe), an eighth of an eager decode call.
_SCRATCH: dict[torch.device, torch.Tensor] = {}
_RETIRED_SCRATCH: list[torch.Tensor] = []
_MIN_SCRATCH = 1 << 16  # elements: 256 KiB
# Elements: 16 MiB. The one-wave split rule's partials at d = 128 take far less (b = 1, 32 query
# heads over 8, 16 splits: 65,536 elements plus 512 for lse_part).
_MAX_SCRATCH = 1 << 22
# Views into the current scratch by (device, elements needed, starts), made once per buffer:
# slicing a CUDA tensor costs about 3 us of the H100 host's time, half an allocation.
_SCRATCH_VIEWS: dict[tuple, tuple[torch.Tensor, ...]] = {}
_MAX_SCRATCH_VIEWS = 1024


def _ticket_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """This device's counter buffer with at least `count` counters, all 0 when the call's
    launch runs; None while the current stream captures a CUDA graph and the buffer is too small
    (the caller merges in a second launch then, see `_grow`)."""
    counters = _TICKETS.get(device)
    if counters is not None and counters.numel() >= count:
        return counters
    return _grow(_TICKETS, _RETIRED_TICKETS, device, count, _MIN_TICKETS, torch.int32)


def _scratch(device: torch.device, count: int) -> torch.Tensor | None:
    """This device's fp32 scratch with at least `count` elements (its contents undefined); None
    where the call should allocate its own: `count` above `_MAX_SCRATCH`, or a buffer too small
    while the current stream captures a CUDA graph."""
    scratch = _SCRATCH.get(device)
    if scratch is not None and scratch.numel() >= count:
        return scratch
    if count > _MAX_SCRATCH:
        return None
    grown = _grow(_SCRATCH, _RETIRED_SCRATCH, device, count, _MIN_SCRATCH, torch.float32)
    if grown is not None:  # views of the old buffer are not handed out again
        for key in [key for key in _SCRATCH_VIEWS if key[0] == device]:
            del _SCRATCH_VIEWS[key]
    return grown


def _scratch_views(device: torch.device, count: int, starts: tuple[int, ...]):
    """Views of this device's scratch (`_scratch(device, count)`) from each of `starts` on, or
    None where `_scratch` gives none; the same views for every call until the buffer grows."""
    key = (device, count, starts)
    views = _SCRATCH_VIEWS.get(key)
    if views is None:
        scratch = _scratch(device, count)
        if scratch is None:
            return None
        views = remember(
            _SCRATCH_VIEWS, key, tuple(scratch[start:] for start in starts), _MAX_SCRATCH_VIEWS
        )
    return views


def _grow(
    kept: dict, retired: list, device: torch.device, count: int, minimum: int, dtype
) -> torch.Tensor | None:
    """Make the device's buffer in `kept` (or a larger one, the old one moved to `retired`),
    zeroed; outside any hot path: once per device and then only when a call needs more than
    ever before.

    Not under CUDA graph capture: there the zero-fill would be recorded into the graph instead
    of run, so the buffer would hold garbage for the eager calls after the capture, and a buffer
    made there would come from the graph's private pool. A call captured before any eager call
    of its size (the library's decode graphs always warm up eagerly first) takes the per-call
    path instead (the merge in a second launch, its own partials), which is always correct."""
    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        return None
    old = kept.get(device)
    size = max(next_pow2(count), minimum, 2 * old.numel() if old is not None else 0)
    buffer = torch.zeros(size, dtype=dtype, device=device)
    if cuda:
        # The zero-fill ran on this stream; later calls may come on another one (DecodeGraph
        # warms up on a side stream, then replays on the caller's). Waiting for it here, once,
        # makes the zeros visible to every stream without events.
        torch.cuda.current_stream(device).synchronize()
    if old is not None:
        retired.append(old)
    kept[device] = buffer
    return buffer


def _fuses_merge(tile_rows: int, block_s: int, block_d: int) -> bool:
    """Whether a split call merges in its main launch: only where one program loads all of a
    tile's partials at once, [next_pow2(rows), block_s, block_d] fp32 within
    `_COMBINE_ELEMENTS` (b = 1, GQA 32:8, d = 128: up to 16 splits). Larger merges take the
    second launch, whose programs each merge one row."""
    return next_pow2(tile_rows) * block_s * block_d <= _COMBINE_ELEMENTS
