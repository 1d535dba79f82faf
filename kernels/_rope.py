"""Rotary position embedding (RoPE), forward and backward: one Triton kernel and its launcher.

Shapes: t [b, s, h, d] (bshd), [s, b, h, d] (sbhd, `seq_dim=0`) or [t, h, d] (thd), any strides
with stride(-1) == 1. cos, sin: fp32 [n_pos, d_rot] (the angle table's cos and sin, computed by
torch: exact, where the GPU's approximate sin/cos lose accuracy on large angles). positions:
None (the token's position is its index along `seq_dim`) or an int tensor of t's leading shape
([s, b], [b, s] or [t]), the row of the table each token uses.
    out [..., h, d] contiguous, t's shape and dtype.

Channel pairs (a, b): rotate-half pairs channel j with j + d_rot/2, interleaved 2j with 2j+1.
With c, s the cos/sin of each channel's own angle:
    forward   out_a = t_a c_a - t_b s_a      out_b = t_b c_b + t_a s_b
    inverse   out_a = t_a c_a + t_b s_b      out_b = t_b c_b - t_a s_a
The inverse is the forward's transpose (the backward of the rotation; for a table whose pair
channels share one angle, as RotaryPositionEmbedding's do, it is the rotation by the negated
angle). Channels d_rot..d pass through. The arithmetic is fp32, the output is cast to t's dtype.

Each program owns BLOCK_T tokens and walks their heads BLOCK_H at a time: a tile is
[BLOCK_T, BLOCK_H, d] with the cos/sin rows of its tokens loaded once per program and broadcast
over the heads, so each program reads its tokens' table rows once and t once, and writes out once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import cdiv, empty, next_pow2, planned
from ._launch import PlannedLaunch, call_signature, int_signature, launch_planned, launch_slot

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements (of t) per [BLOCK_T, BLOCK_H, d] tile and the warps that hold it: 16 per thread at
# 8 warps, two 16-byte bf16 vectors per half-row chunk. A first choice for a streaming kernel, not
# measured against others yet (examples/perf/benchmark_rope.py is the place to do it).
_TILE, _NUM_WARPS = 4096, 8
# Heads per tile at most: the cos/sin of a token broadcast over them; more would shrink BLOCK_T
# below a useful number of tokens for d = 128.
_MAX_BLOCK_H = 8


@triton.jit
def _load_pairs(base, ok, half, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(channel a, channel b) of every rotated pair, fp32 [R, C, BLOCK_P] each.

    `base` [R, C]: pointers to channel 0 of each row; `ok` [R, C]: rows that exist. Interleaved
    loads the 2 * BLOCK_P contiguous channels and splits even from odd; rotate-half loads the two
    contiguous halves. Either way every load is contiguous along the channels.
    """
    pairs = tl.arange(0, BLOCK_P)
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_P)
        mask = ok[:, :, None] & (cols < 2 * half)[None, None, :]
        x = tl.load(base[:, :, None] + cols[None, None, :], mask=mask, other=0.0)
        x = tl.reshape(x.to(tl.float32), [x.shape[0], x.shape[1], BLOCK_P, 2])
        first, second = tl.split(x)
    else:
        mask = ok[:, :, None] & (pairs < half)[None, None, :]
        ptrs = base[:, :, None] + pairs[None, None, :]
        first = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(ptrs + half, mask=mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _store_pairs(base, ok, first, second, half, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Store the pairs `_load_pairs` loaded from the same places (cast to base's dtype)."""
    dtype = base.dtype.element_ty
    if INTERLEAVED:
        cols = tl.arange(0, 2 * BLOCK_P)
        mask = ok[:, :, None] & (cols < 2 * half)[None, None, :]
        x = tl.reshape(tl.join(first, second), [first.shape[0], first.shape[1], 2 * BLOCK_P])
        tl.store(base[:, :, None] + cols[None, None, :], x.to(dtype), mask=mask)
    else:
        pairs = tl.arange(0, BLOCK_P)
        mask = ok[:, :, None] & (pairs < half)[None, None, :]
        ptrs = base[:, :, None] + pairs[None, None, :]
        tl.store(ptrs, first.to(dtype), mask=mask)
        tl.store(ptrs + half, second.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    T, Out, Cos, Sin, Pos,
    stride_tb, stride_ts, stride_th,
    stride_ob, stride_os, stride_oh,
    stride_pb, stride_ps, stride_table,
    n_tokens, seq_len, n_heads,
    t2_from_t, out2_from_out,
    stride_tb2, stride_ts2, stride_th2,
    stride_ob2, stride_os2, stride_oh2,
    n_heads2,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
    PAIR: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    """Tokens are numbered b-major over the [b, s] view the launcher makes: token = bi * s + si.
    BLOCK_P = next_pow2(ROT_DIM / 2) pairs; BLOCK_PASS = next_pow2(HEAD_DIM - ROT_DIM), 0 when
    every channel rotates.

    PAIR: a second tensor with the same tokens and positions (k beside q) is rotated by the
    programs of grid axis 1 = 1: it starts `t2_from_t` elements after T (its output
    `out2_from_out` after Out; either may be negative) and has its own strides and head count.
    """
    tl.static_assert(ROT_DIM % 2 == 0)
    half = ROT_DIM // 2
    if PAIR:
        second = tl.program_id(1) == 1
        T += tl.where(second, t2_from_t, 0)
        Out += tl.where(second, out2_from_out, 0)
        stride_tb = tl.where(second, stride_tb2, stride_tb)
        stride_ts = tl.where(second, stride_ts2, stride_ts)
        stride_th = tl.where(second, stride_th2, stride_th)
        stride_ob = tl.where(second, stride_ob2, stride_ob)
        stride_os = tl.where(second, stride_os2, stride_os)
        stride_oh = tl.where(second, stride_oh2, stride_oh)
        n_heads = tl.where(second, n_heads2, n_heads)
    # int64 before any multiply by a stride: token * stride passes 2**31 on large activations.
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tokens_ok = tokens < n_tokens
    bi = tokens // seq_len
    si = tokens % seq_len
    if HAS_POSITIONS:
        pos = tl.load(Pos + bi * stride_pb + si * stride_ps, mask=tokens_ok, other=0).to(tl.int64)
    else:
        pos = si  # dense from position 0: the index along the sequence
    # Table rows as [BLOCK_T, 1] pointers: their [BLOCK_T, 1, BLOCK_P] pairs broadcast over heads.
    row_ok = tokens_ok[:, None]
    table_row = (pos * stride_table)[:, None]
    cos_a, cos_b = _load_pairs(Cos + table_row, row_ok, half, BLOCK_P, INTERLEAVED)
    sin_a, sin_b = _load_pairs(Sin + table_row, row_ok, half, BLOCK_P, INTERLEAVED)
    if INVERSE:  # the transpose: each output takes its partner's sin, negated
        sin_a, sin_b = -sin_b, -sin_a
    t_token = bi * stride_tb + si * stride_ts
    o_token = bi * stride_ob + si * stride_os
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
        ok = row_ok & (heads < n_heads)[None, :]
        t_base = T + (t_token[:, None] + heads[None, :] * stride_th)
        o_base = Out + (o_token[:, None] + heads[None, :] * stride_oh)
        rotate_tile(
            t_base, o_base, ok, cos_a, cos_b, sin_a, sin_b,
            HEAD_DIM, ROT_DIM, BLOCK_P, BLOCK_PASS, INTERLEAVED,
        )  # fmt: skip


@triton.jit
def rotate_tile(
    t_base, o_base, ok, cos_a, cos_b, sin_a, sin_b,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """One [R, C] tile of rows (pointers to channel 0 in t and out, `ok` the rows that exist):
    rotate its channel pairs by the [R, 1, BLOCK_P] cos/sin pairs and copy the channels past
    ROT_DIM."""
    half = ROT_DIM // 2
    x_a, x_b = _load_pairs(t_base, ok, half, BLOCK_P, INTERLEAVED)
    out_a = x_a * cos_a - x_b * sin_a
    out_b = x_b * cos_b + x_a * sin_b
    _store_pairs(o_base, ok, out_a, out_b, half, BLOCK_P, INTERLEAVED)
    if BLOCK_PASS > 0:  # partial rotation: channels ROT_DIM..HEAD_DIM are copied
        cols = ROT_DIM + tl.arange(0, BLOCK_PASS)
        mask = ok[:, :, None] & (cols < HEAD_DIM)[None, None, :]
        rest = tl.load(t_base[:, :, None] + cols[None, None, :], mask=mask)
        tl.store(
            o_base[:, :, None] + cols[None, None, :], rest.to(o_base.dtype.element_ty), mask=mask
        )


def _as_bshd(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """A [b, s, ...] view of x: [s, b, ...] transposed (seq_dim 0), [b, s, ...] as it is
    (seq_dim 1), thd's [t, ...] as one sequence [1, t, ...]. Never a copy."""
    if x.dim() == 1 or x.dim() == 3:  # thd tokens [t] / t [t, h, d]
        return x.unsqueeze(0)
    return x.transpose(0, 1) if seq_dim == 0 else x


def _floor_pow2(n: int) -> int:
    """The largest power of two <= n (n >= 1): tl.arange takes powers of two only."""
    return 1 << (n.bit_length() - 1)


def _geometry(n_heads: int, head_dim: int, rot_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_P, BLOCK_PASS) for heads of head_dim channels."""
    block_p = next_pow2(max(1, rot_dim // 2))
    block_pass = next_pow2(head_dim - rot_dim) if head_dim > rot_dim else 0
    row = 2 * block_p + block_pass
    # The largest power of two dividing n_heads (12 -> 4, 32 -> 8): the head loop has no ragged
    # last step that would leave lanes masked off.
    block_h = min(n_heads & -n_heads, _MAX_BLOCK_H, _floor_pow2(max(1, _TILE // row)))
    block_t = _floor_pow2(max(1, _TILE // (block_h * row)))
    return block_t, block_h, block_p, block_pass


def rotate(
    ts: tuple[torch.Tensor, ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    seq_dim: int,
    interleaved: bool,
    inverse: bool,
) -> tuple[torch.Tensor, ...]:
    """RoPE of each tensor of `ts` (the forward), or its transpose with `inverse` (the backward
    of the incoming gradient), in one launch; see the module docstring for shapes. One tensor,
    or two with the same leading (token) dims, dtype, device, head dim and positions and their
    own head counts and strides (q and k of one self-attention layer), whose outputs then lie
    back to back in one buffer, the first's first. Assumes validated input: fp16/bf16/fp32 on
    cos/sin's device, d_rot = cos.shape[1] even and <= d, every position below n_pos. Reads the
    tensors in place (a copy only when stride(-1) != 1)."""
    ts = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)
    cos, sin = cos.contiguous(), sin.contiguous()
    t = ts[0]
    pair = len(ts) == 2
    # Where the second tensor starts, from the first's address: a runtime int of the launch.
    t2_from_t = (ts[1].data_ptr() - t.data_ptr()) // t.element_size() if pair else 0
    signature = call_signature(
        (*ts, cos, sin, positions),
        (seq_dim, interleaved, inverse, int_signature(t2_from_t)),
    )
    plan = planned(
        _PLANS, signature, (), lambda: _plan(ts, cos, positions, seq_dim, interleaved, inverse)
    )
    if not pair:
        outs = (empty(t.shape, t.dtype, t.device),)
        out = outs[0]
    else:
        # One buffer for both outputs, the second 16-byte aligned as the allocator's buffers
        # are: one allocation, and the attention backward can write both gradients into one.
        # (Sizes passed one by one, as `_common.empty` does: a torch.Size parses slower.)
        out = torch.empty(plan.out_start + ts[1].numel(), dtype=t.dtype, device=t.device)
        outs = (out[: t.numel()].view(*t.shape), out[plan.out_start :].view(*ts[1].shape))
    if t.numel() == 0:
        return outs
    run = plan.launch
    # The kernel takes each tensor's address with the strides of its [b, s, ...] view (the
    # plan's), so the tensors go as they are; an absent `positions` has cos stand in.
    launch_planned(_rope_kernel, run,
        t, out, cos, sin, cos if positions is None else positions, *run.ints,
        t2_from_t, plan.out_start if pair else 0, *plan.second_ints,
        signature=signature,
    )  # fmt: skip
    return outs


class _RopePlan(NamedTuple):
    """What a `rotate` launch derives from its call's signature, once per signature: the launch
    (its ints: those before the second tensor's offsets), the ints after those offsets, and
    where the second output starts in the pair's buffer."""

    launch: PlannedLaunch
    second_ints: tuple
    out_start: int


# Plans by signature (`rotate`; `planned`).
_PLANS: dict[tuple, _RopePlan] = {}


def _plan(ts, cos, positions, seq_dim, interleaved, inverse) -> _RopePlan:
    """`rotate`'s plan, from the shapes and strides of its inputs (outputs: contiguous)."""
    t = ts[0]
    pair = len(ts) == 2
    align = max(1, 16 // t.element_size())
    out_start = -(-t.numel() // align) * align if pair else 0
    t4s = [_as_bshd(x, seq_dim) for x in ts]
    out4s = [_as_bshd(torch.empty(x.shape, device="meta"), seq_dim) for x in ts]
    b, s, _, head_dim = t4s[0].shape
    heads = [x.shape[2] for x in t4s]
    rot_dim = cos.shape[1]
    pos2 = None if positions is None else _as_bshd(positions, seq_dim)
    # A head block both tensors' head counts divide (the largest power of two dividing both).
    block_t, block_h, block_p, block_pass = _geometry(math.gcd(*heads), head_dim, rot_dim)
    n_tokens = b * s
    t4b, out4b = t4s[-1], out4s[-1]
    ints = (
        *t4s[0].stride()[:3], *out4s[0].stride()[:3],
        0 if pos2 is None else pos2.stride(0), 0 if pos2 is None else pos2.stride(1),
        cos.stride(0), n_tokens, s, heads[0],
    )  # fmt: skip
    second_ints = (*t4b.stride()[:3], *out4b.stride()[:3], heads[-1])
    kwargs = dict(
        HEAD_DIM=head_dim, ROT_DIM=rot_dim,
        HAS_POSITIONS=pos2 is not None, INTERLEAVED=interleaved, INVERSE=inverse, PAIR=pair,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_P=block_p, BLOCK_PASS=block_pass,
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    grid = (cdiv(n_tokens, block_t), len(ts))
    return _RopePlan(PlannedLaunch(grid, ints, kwargs, launch_slot()), second_ints, out_start)
