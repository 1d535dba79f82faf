"""Shared attention-kernel helpers: tile masks, score modifications, dropout, launch geometry.

Legend (per program): a query tile holds rows `offs_m` [BLOCK_M] and a key tile columns `offs_n`
[BLOCK_N], both as positions *within the sequence* (row 0 = the sequence's first token). Every mask
and score helper works on those positions, so dense, padded and varlen launches share one code path.
The tile helpers take them as broadcastable 2-D index tiles `qi` (query positions) and `kj` (key
positions), which fix the tile's orientation: `offs_m[:, None]`, `offs_n[None, :]` build query-major
[BLOCK_M, BLOCK_N] tiles (forward, dQ), `offs_m[None, :]`, `offs_n[:, None]` key-major [BLOCK_N,
BLOCK_M] ones (dK/dV), element for element the same values, with no transpose.

Mask semantics (docs/internals.md): query i sees key j iff `i + diag - left <= j` (left >= 0) and
`j <= i + diag + right` (right >= 0), with `diag = len_k - len_q` when bottom-right aligned, else 0.

Scores inside the kernels live in the log2 domain: `s2 = s * log2(e)`, so `exp2(s2 - m2)` is the
softmax numerator; the LSE is converted back to natural log when stored.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._launch import call_signature, int_signature

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# How a launch finds each sequence's first row in memory and its length (`seq_bounds`).
SEQ_DENSE = 0  # start 0, length = the padded length
SEQ_DENSE_LENS = 1  # start 0, length = seqlens[z] (right padding)
SEQ_VARLEN = 2  # start = cu_seqlens[z], length = cu_seqlens[z + 1] - cu_seqlens[z]
SEQ_VARLEN_OFFSETS = 3  # start = seq_offsets[z], length from cu_seqlens


# --------------------------------------------------------------------------------------------------
# Sequence geometry
# --------------------------------------------------------------------------------------------------


@triton.jit
def seq_bounds(z, cu_seqlens_ptr, seq_offsets_ptr, seqlens_ptr, full_len, SEQ_MODE: tl.constexpr):
    """(first row in memory, length) of sequence z, both int32 scalars."""
    if SEQ_MODE == 0:
        start = z * 0
        length = full_len + z * 0
    elif SEQ_MODE == 1:
        start = z * 0
        length = tl.load(seqlens_ptr + z)
    else:
        cu_lo = tl.load(cu_seqlens_ptr + z)
        length = tl.load(cu_seqlens_ptr + z + 1) - cu_lo
        if SEQ_MODE == 3:
            start = tl.load(seq_offsets_ptr + z)
        else:
            start = cu_lo
    return start, length


@triton.jit
def interleaved_tile(pid, num_blocks, num_pairs, order_pairs):
    """(pair, i) of program `pid` in a causal-like launch order: the programs of `order_pairs`
    consecutive (sequence, head) pairs at a time, pairs varying fastest, i = 0 for each
    group's first programs. Callers map i = 0 to their longest block (the forward's last query
    block, the backward's first key block); `causal_order_heads` says why."""
    per_group = num_blocks * order_pairs
    first = (pid // per_group) * order_pairs
    pairs = tl.minimum(order_pairs, num_pairs - first)  # the last group may be smaller
    r = pid % per_group
    return first + r % pairs, r // pairs


@triton.jit
def diagonal_offset(len_q, len_k, BOTTOM_RIGHT: tl.constexpr):
    """Column of row 0's diagonal: `len_k - len_q` bottom-right aligned, 0 top-left."""
    if BOTTOM_RIGHT:
        diag = len_k - len_q
    else:
        diag = len_q * 0
    return diag


# --------------------------------------------------------------------------------------------------
# Visibility
# --------------------------------------------------------------------------------------------------


@triton.jit
def visible_tile(
    qi,
    kj,
    diag,
    window_left,
    window_right,
    len_q,
    len_k,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    CHECK_K: tl.constexpr,
    CHECK_Q: tl.constexpr,
):
    """Bool tile: True where query qi may attend to key kj (index tiles: see the module legend).

    HAS_LEFT / HAS_RIGHT: the window bound is finite (-1 = unbounded, then the runtime value is
    ignored). CHECK_K / CHECK_Q add the key-length / query-length bound (the backward needs the
    query bound so padded rows contribute nothing to dK/dV).
    """
    rel = kj - (qi + diag)  # j - (i + diag), the full tile
    visible = rel == rel
    if HAS_LEFT:
        visible = visible & (rel >= -window_left)
    if HAS_RIGHT:
        visible = visible & (rel <= window_right)
    if CHECK_K:
        visible = visible & (kj < len_k)
    if CHECK_Q:
        visible = visible & (qi < len_q)
    return visible


@triton.jit
def key_block_range(
    start_m,
    diag,
    window_left,
    window_right,
    len_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Key range for query rows [start_m, start_m + BLOCK_M), as (lo, full_lo, full_hi, hi).

    Keys outside [lo, hi) are invisible to every row (those blocks are skipped); keys in
    [full_lo, full_hi) are visible to every row and inside len_k (no mask needed). lo, full_lo and
    full_hi are multiples of BLOCK_N or equal to hi; lo <= full_lo <= full_hi <= hi. When no key
    is visible, hi <= lo and every segment is empty.
    """
    last_m = start_m + BLOCK_M - 1
    lo = start_m * 0
    hi = len_k
    full_lo = start_m * 0
    full_hi = len_k
    if HAS_LEFT:
        lo = tl.maximum(start_m + diag - window_left, 0)
        full_lo = tl.maximum(last_m + diag - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(last_m + diag + window_right + 1, len_k)
        full_hi = tl.minimum(start_m + diag + window_right + 1, len_k)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), tl.maximum(hi, lo))
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), tl.maximum(hi, full_lo))
    return lo, full_lo, full_hi, hi


@triton.jit
def query_block_range(
    start_n,
    diag,
    window_left,
    window_right,
    len_q,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Query range for key columns [start_n, start_n + BLOCK_N), as (lo, full_lo, full_hi, hi).

    The mirror of `key_block_range` for loops over query blocks (the backward's dK/dV pass): rows
    outside [lo, hi) see none of these keys; rows in [full_lo, full_hi) see all of them and are
    inside len_q. lo, full_lo, full_hi are multiples of BLOCK_M or equal to hi.
    """
    last_n = start_n + BLOCK_N - 1
    lo = start_n * 0
    hi = len_q
    full_lo = start_n * 0
    full_hi = len_q
    # j <= i + diag + right  <=>  i >= j - diag - right
    # j >= i + diag - left   <=>  i <= j - diag + left
    if HAS_RIGHT:
        lo = tl.maximum(start_n - diag - window_right, 0)
        full_lo = tl.maximum(last_n - diag - window_right, 0)
    if HAS_LEFT:
        hi = tl.minimum(last_n - diag + window_left + 1, len_q)
        full_hi = tl.minimum(start_n - diag + window_left + 1, len_q)
    lo = (lo // BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, lo), tl.maximum(hi, lo))
    full_hi = (full_hi // BLOCK_M) * BLOCK_M
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), tl.maximum(hi, full_lo))
    return lo, full_lo, full_hi, hi


# --------------------------------------------------------------------------------------------------
# Tile loads
# --------------------------------------------------------------------------------------------------
# A mask that varies along the contiguous head dim gives every element its own predicate, so the
# load neither vectorizes nor pipelines (cp.async copies at least 4 bytes under one predicate).
# The backward once masked every load by a runtime head dim: ncu on the H100 showed its dK/dV
# kernel at 255 registers with 12.8M spill requests, and its Q/dO loads were not pipelined
# (2026-11-23, docs/performance.md, "The portable backward"). Hence: mask the head dim only where
# it is padded, and rows only on blocks that can run past the sequence.


@triton.jit
def dim_mask(offs_d, d, PADDED: tl.constexpr):
    """offs_d < d when the head dim is padded up to its tile width; otherwise a constant
    all-true mask, which the compiler sees as constant along the head dim."""
    if PADDED:
        ok = offs_d < d
    else:
        ok = tl.full(offs_d.shape, 1, tl.int1)
    return ok


@triton.jit
def load_tile(ptrs, row_ok, dim_ok, CHECK_ROWS: tl.constexpr, PADDED: tl.constexpr,
              ROWS_AXIS: tl.constexpr):  # fmt: skip
    """A tile of a row-major operand, 0 where masked; rows lie along axis ROWS_AXIS (1 for a
    transposed [d, rows] tile) and the head dim along the other. Masks rows (`row_ok`) only when
    CHECK_ROWS and head-dim columns (`dim_ok`) only when PADDED: a full tile loads unmasked."""
    if ROWS_AXIS == 0:
        rows = row_ok[:, None]
        dims = dim_ok[None, :]
    else:
        rows = row_ok[None, :]
        dims = dim_ok[:, None]
    if CHECK_ROWS and PADDED:
        tile = tl.load(ptrs, mask=rows & dims, other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=rows, other=0.0)
    elif PADDED:
        tile = tl.load(ptrs, mask=dims, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


# --------------------------------------------------------------------------------------------------
# Score modifications
# --------------------------------------------------------------------------------------------------


@triton.jit
def tanh_f32(x):
    """tanh in fp32 to a few units of its last place (written out: the libdevice path differs
    between Triton releases).

    From |x| = 0.3 on, 1 - 2 / (e^{2|x|} + 1) (stable as e^{2|x|} overflows); below, where that
    difference cancels (its relative error grows as eps / |x|: 30x PyTorch's at a softcap of
    30), tanh's odd Taylor series to x^13, whose next term is under 1e-9 relative there.
    """
    ax = tl.abs(x)
    far = 1.0 - 2.0 / (tl.exp2(ax * (2.0 * LOG2E)) + 1.0)
    x2 = x * x
    near = x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0 + x2 * (-1382.0 / 155925.0 + x2 * (
        21844.0 / 6081075.0))))  # fmt: skip
    near = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + near)))
    return tl.where(ax < 0.3, near, tl.where(x < 0, -far, far))


@triton.jit
def load_bias_tile(bias_base, qi, kj, stride_m, stride_n, len_q, len_k):
    """fp32 tile of an additive bias at index tiles qi, kj (module legend); 0 past len_q, len_k.

    bias_base points at bias[z, h, 0, 0]; offsets are int64 because s_q * s_k can pass 2^31.
    Strides may be 0 (broadcast dims).
    """
    ptrs = bias_base + qi.to(tl.int64) * stride_m + kj.to(tl.int64) * stride_n
    mask = (qi < len_q) & (kj < len_k)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def alibi_tile(slope, qi, kj, diag):
    """ALiBi term `-slope * |i + diag - j|`, an fp32 tile at index tiles qi, kj (module legend)."""
    dist = tl.abs(qi + diag - kj).to(tl.float32)
    return -slope * dist


@triton.jit
def scores_log2(
    qk,
    sm_scale,
    softcap,
    bias_tile,
    alibi_slope,
    qi,
    kj,
    diag,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """Log2-domain scores from raw q.k (fp32, at index tiles qi, kj), in the contract's order.

    s = qk * scale; softcap * tanh(s / softcap); + bias; + alibi; then * log2(e). Masking is the
    caller's (it needs -inf after all of these). `bias_tile` is ignored unless HAS_BIAS.
    """
    if HAS_SOFTCAP:
        # log2(e) folded into the cap: one multiply per element on the common path.
        s = tanh_f32(qk * (sm_scale / softcap)) * (softcap * LOG2E)
    else:
        # exp2 with log2(e) folded into the scale.
        s = qk * (sm_scale * LOG2E)
    if HAS_BIAS:
        s += bias_tile * LOG2E
    if HAS_ALIBI:
        s += alibi_tile(alibi_slope, qi, kj, diag) * LOG2E
    return s


@triton.jit
def delta_minus_dlse(delta, lse, dlse):
    """The backward's delta with the LSE's upstream gradient folded in: delta - dlse.

    d lse_i / d s_ij = P_ij, so dlse adds P * dlse to dS = P * (dP - delta): the same as
    running the backward with delta - dlse (natural-log units, as the LSE is stored; dS is the
    gradient of the natural-log scores in every kernel). A row with no visible key (LSE -inf)
    has P = 0 and keeps its delta: a NaN or inf dlse there would turn 0 * (dP - delta) into NaN.
    """
    return delta - tl.where(lse == float("-inf"), 0.0, dlse)


# --------------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------------


@triton.jit
def dropout_keep(seed, offset, bh, qi, kj, dropout_p):
    """Bool keep tile (True with probability 1 - p) for (bh, i, j) at index tiles qi, kj (module
    legend).

    Counter-based Philox: the 128-bit counter is (j, i, bh, offset) as four uint32 words and the key
    is the 64-bit seed, so the draw is a pure function of (seed, offset, batch*heads index, i, j),
    independent of block sizes and launch order, and nothing overflows below 2^32 rows, keys or
    batch*heads. `offset` contributes its low 32 bits. `bh` = z * num_heads_q + h.
    """
    zero = (qi * 0 + kj * 0).to(tl.uint32)
    c0 = kj.to(tl.uint32) + zero
    c1 = qi.to(tl.uint32) + zero
    c2 = zero + bh.to(tl.uint32)
    # Widen first: the offset may be an int32, an int64 or (value 1) a specialized constexpr;
    # int64 -> uint32 then keeps the low bits.
    c3 = (zero.to(tl.int64) + offset).to(tl.uint32)
    r0, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return tl.uint_to_uniform_float(r0) >= dropout_p


# --------------------------------------------------------------------------------------------------
# Host side: one description of dense, padded and varlen launches
# --------------------------------------------------------------------------------------------------


class SeqArgs(NamedTuple):
    """How kernels locate one operand's sequences; see `seq_bounds`."""

    mode: int
    cu_seqlens: torch.Tensor | None
    seq_offsets: torch.Tensor | None
    seqlens: torch.Tensor | None
    max_len: int  # padded length (dense) or max_seqlen (varlen): the grid's extent
    owns_all_rows: bool  # False when some memory rows belong to no sequence (zero-fill outputs)


class LaunchGeometry(NamedTuple):
    batch: int
    varlen: bool
    q: SeqArgs
    k: SeqArgs

    @property
    def dense(self) -> bool:
        """q and k dense without seqlens: the geometry holds no tensor."""
        return self.q.mode == SEQ_DENSE and self.k.mode == SEQ_DENSE


def strides4(t: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(stride_b, stride_s, stride_h, stride_d) of a dense [b, s, h, d] or varlen [t, h, d] tensor.

    Varlen tensors get stride_b = 0: row i of sequence z lives at (start_z + i) * stride_s.
    """
    if varlen:
        return (0, t.stride(0), t.stride(1), t.stride(2))
    return (t.stride(0), t.stride(1), t.stride(2), t.stride(3))


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, row) strides of a dense [b, h, s] or varlen [h, t] LSE-shaped tensor
    (varlen: batch stride 0, as for strides4)."""
    if varlen:
        return 0, lse.stride(0), lse.stride(1)
    return lse.stride(0), lse.stride(1), lse.stride(2)


def _seq_args(x, cu_seqlens, seq_offsets, max_seqlen, seqlens) -> SeqArgs:
    if cu_seqlens is not None:
        if seq_offsets is not None:
            mode = SEQ_VARLEN_OFFSETS
            return SeqArgs(mode, cu_seqlens, seq_offsets, None, int(max_seqlen), False)
        # Tokens past cu_seqlens[-1] would be unowned; zero-filling avoids a device sync to check.
        return SeqArgs(SEQ_VARLEN, cu_seqlens, None, None, int(max_seqlen), False)
    if seqlens is not None:
        return SeqArgs(SEQ_DENSE_LENS, None, None, seqlens, x.shape[1], False)
    return SeqArgs(SEQ_DENSE, None, None, None, x.shape[1], True)


def launch_geometry(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seq_offsets_q=None,
    seq_offsets_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    seqlens_q=None,
    seqlens_k=None,
) -> LaunchGeometry:
    """Normalize a dense / padded / varlen launch (docs/internals.md layouts) for the kernels.

    dense: q [b, s_q, h, d], optional seqlens_q/k int32 [b]; varlen: q [t_q, h, d] with
    cu_seqlens_q/k int32 [b+1], max_seqlen_q/k and optional seq_offsets_q/k int32 [b+1].
    """
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    return LaunchGeometry(
        batch=batch,
        varlen=varlen,
        q=_seq_args(q, cu_seqlens_q, seq_offsets_q, max_seqlen_q, seqlens_q),
        k=_seq_args(k, cu_seqlens_k, seq_offsets_k, max_seqlen_k, seqlens_k),
    )


def attention_signature(
    q, k, v, *, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q,
    max_seqlen_k, seqlens_q, seqlens_k, softmax_scale, window_left, window_right, bottom_right,
    bias, alibi_slopes, softcap, dropout_p, seed, offset, descale=None, **_unused,
) -> tuple:  # fmt: skip
    """The `_launch.call_signature` of an attention call's inputs and arguments: what the
    forward's plan and launch specialize on, and the part of the backward's signature the two
    share (the eager route computes it once per forward+backward). `descale`: the fp8 forward's
    (the backward never has one). Other keywords are ignored."""
    return call_signature(
        (q, k, v, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, seqlens_q, seqlens_k,
         bias, alibi_slopes, descale),
        (max_seqlen_q, max_seqlen_k, softmax_scale, window_left, window_right, bottom_right,
         softcap, dropout_p, int_signature(seed), int_signature(offset)),
    )  # fmt: skip


def shape_only_geometry(geom: LaunchGeometry) -> LaunchGeometry | None:
    """`geom` when it holds no tensor (dense q and k without seqlens): it then follows from the
    shapes alone, so a plan can keep it for every call of its signature instead of normalizing
    the arguments again per call. None otherwise: its tensors are the call's."""
    return geom if geom.dense else None


def seq_pointers(geom: LaunchGeometry, order: tuple[int, ...]) -> operator.itemgetter:
    """For a plan: a getter that takes a call's (cu_seqlens_q, cu_seqlens_k, seq_offsets_q,
    seq_offsets_k, seqlens_q, seqlens_k, stand-in) and returns, at the positions `order` names,
    each tensor `geom` uses, the stand-in for the others. Which ones it uses follows from which
    are given (`launch_geometry`), so the getter holds for every call of one signature."""
    used = (geom.q.cu_seqlens, geom.k.cu_seqlens, geom.q.seq_offsets, geom.k.seq_offsets,
            geom.q.seqlens, geom.k.seqlens)  # fmt: skip
    return operator.itemgetter(*(i if used[i] is not None else len(used) for i in order))


def remember(table: dict, key, value, limit: int):
    """`table[key] = value`, emptying the table first when it holds `limit` entries; returns
    `value`. Per-signature tables stay bounded through a long run of new shapes, and the common
    case, a few signatures repeated every step, refills them at once."""
    if len(table) >= limit:
        table.clear()
    table[key] = value
    return value


# A kernel module's table of launch plans holds at most this many (`remember`).
MAX_PLANS = 1024


def planned(table: dict, signature, settings: tuple, make):
    """A call's launch plan: kept in `table` under (signature, *settings) and made by `make()`
    the first time; a call without a signature (None) gets a fresh plan every time."""
    if signature is None:
        return make()
    key = (signature, *settings)
    plan = table.get(key)
    return plan if plan is not None else remember(table, key, make(), MAX_PLANS)


# The launchers' per-call buffers. The sizes go to torch one by one: its argument parser reads
# a run of ints in 0.9 us on a 2-core CPU and a torch.Size in 1.6 (a tuple 1.2; torch 2.13),
# and a forward+backward allocates five such buffers.


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype, device=device)`: a new contiguous buffer."""
    if not shape:  # no sizes at all: torch.empty() would ask for one
        return torch.empty((), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)


def zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype, device=device)`."""
    if not shape:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.zeros(*shape, dtype=dtype, device=device)


def seed_offset(rng) -> tuple[int, int]:
    """(seed, offset) as Python ints from an rng_state (an int64 tensor [2]) or a (seed, offset)
    pair of ints or 0-d tensors; (0, 0) for None (no dropout)."""
    if rng is None:
        return 0, 0
    seed, offset = rng.tolist() if isinstance(rng, torch.Tensor) else rng
    return int(seed), int(offset)


# Host-side integer helpers for the launchers. Plain arithmetic on purpose: `triton.cdiv` and
# `triton.next_power_of_2` go through Triton's constexpr-function wrapper, ~5 us of host time per
# call on a 2-core CPU, and a forward+backward made eight such calls.


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The next power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def next_pow2_dim(d: int) -> int:
    """Padded tile width for a head dim: next power of two, at least 16 (tl.dot's minimum K)."""
    return max(16, next_pow2(d))


# Causal launches order their programs longest-first across a few (sequence, head) pairs at a
# time (`causal_order_heads`): pairs whose streamed tiles (K and V in the forward) together fit
# this many bytes, a third of the H100's 50 MB L2, so the programs running at once still share
# them there. 0 turns the interleaving off (one pair at a time, longest-first within it: the
# order before 2026-11-25).
CAUSAL_ORDER_L2_BYTES = 16 << 20


def causal_order_heads(length: int, row_bytes: int, sharing: int, num_pairs: int) -> int:
    """How many consecutive (sequence, head) pairs a causal launch interleaves
    (`interleaved_tile`).

    Under a causal mask a program's work grows with its query block (forward) or shrinks with its
    key block (backward). The GPU starts programs in launch order as SMs free up (greedy list
    scheduling), which is near-optimal when the longest programs come first. Longest-first within
    one pair at a time (the order before) still starts each pair's longest programs after the
    previous pair's shortest: the last pair's long programs then run alone at the end (5-7% over
    the ideal makespan at s = 4k on 132 SMs, simulated). Interleaving a few pairs' blocks, longest
    first across them, ends every launch on short programs (1.00-1.04x the ideal with 8 pairs,
    1.00-1.02x with 16, simulated at s = 1k-16k) while what those pairs stream (`length` rows of
    `row_bytes` each, read by `sharing` consecutive pairs alike: a GQA group's query heads share K
    and V) stays within `CAUSAL_ORDER_L2_BYTES`. Whole sharing groups, at least one, at most
    `num_pairs`.
    """
    if not CAUSAL_ORDER_L2_BYTES:
        return 1
    streams = CAUSAL_ORDER_L2_BYTES // max(1, length * row_bytes)
    return max(1, min(num_pairs, max(1, streams) * sharing))


def rows_view(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """t [..., n] as [m, n] with a unit column stride (a view whenever possible)."""
    t2 = t.reshape(-1, n_cols)
    return t2 if t2.stride(-1) == 1 or n_cols == 1 else t2.contiguous()


def rows_in_place(*tensors: torch.Tensor | None) -> bool:
    """Each tensor (None skipped) is its own `rows_view` (a view at its own address), so a kernel
    can take it as it is with the view's row stride. Depends on shapes and strides alone: a
    launch plan works it out once per signature."""
    return all(t is None or rows_view(t, t.shape[-1]).data_ptr() == t.data_ptr() for t in tensors)


# Device properties for launch decisions, read once per device (the query costs host time).
# The H100's values stand in where there is no CUDA device (the interpreter).
H100_MULTIPROCESSORS, H100_SMEM_PER_BLOCK = 132, 227 * 1024


@functools.cache
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _properties(device: torch.device):
    if device.type != "cuda":
        return None
    return _cuda_properties(
        device.index if device.index is not None else torch.cuda.current_device()
    )


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of `device`."""
    props = _properties(device)
    return H100_MULTIPROCESSORS if props is None else props.multi_processor_count


def smem_per_block(device: torch.device) -> int:
    """Bytes of shared memory one block may use on `device` (its opt-in limit)."""
    props = _properties(device)
    return getattr(props, "shared_memory_per_block_optin", H100_SMEM_PER_BLOCK)


def head_row_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of one row of one head of each tensor, summed: what a program streams per row."""
    return sum(t.shape[-1] * t.element_size() for t in tensors)
