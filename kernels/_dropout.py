"""The dropout keep-mask the attention kernels apply, materialized for tests and the reference.

Built by a Triton kernel from the same `dropout_keep` helper the attention kernels call, so the mask
is bit-identical to what the forward and backward used for the same (seed, offset).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, dropout_keep, seed_offset
from ._launch import launch


@triton.jit
def _keep_mask_kernel(
    out_ptr,
    seed,
    offset,
    dropout_p,
    s_q,
    s_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Writes keep[bh, i, j] (uint8) for one BLOCK_M x BLOCK_N tile of one (batch, head)."""
    start_m = tl.program_id(0) * BLOCK_M
    start_n = tl.program_id(1) * BLOCK_N
    bh = tl.program_id(2)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed, offset, bh, offs_m[:, None], offs_n[None, :], dropout_p)
    # int64 addressing: b * h * s_q * s_k can pass 2^31.
    base = out_ptr + bh.to(tl.int64) * s_q * s_k
    ptrs = base + offs_m.to(tl.int64)[:, None] * s_k + offs_n[None, :]
    mask = (offs_m[:, None] < s_q) & (offs_n[None, :] < s_k)
    tl.store(ptrs, keep.to(tl.uint8), mask=mask)


def dropout_keep_mask(
    rng_state_or_seed_offset,
    b: int,
    h: int,
    s_q: int,
    s_k: int,
    p: float,
    device,
) -> torch.Tensor:
    """Bool keep-mask [b, h, s_q, s_k] (True = keep, probability 1 - p) the kernels use.

    rng_state_or_seed_offset: int64 tensor [2] = (seed, offset) or a (seed, offset) pair. Element
    (z, hh, i, j) depends only on (seed, offset, z * h + hh, i, j), with i, j positions within the
    sequence, so varlen launches use the same mask with s_q / s_k = the max lengths.
    """
    seed, offset = seed_offset(rng_state_or_seed_offset)
    out = torch.empty((b, h, s_q, s_k), dtype=torch.uint8, device=device)
    block_m, block_n = 32, 64
    grid = (cdiv(s_q, block_m), cdiv(s_k, block_n), b * h)
    launch(
        _keep_mask_kernel, grid, out, seed, offset, float(p), s_q, s_k,
        BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return out.bool()
