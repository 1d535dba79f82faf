"""One decode step's new rows into a KV cache, with their rotary embedding, in one launch.

Before the split-KV attention (`_flash_decode`), a step rotates the new queries and keys and
writes the keys and values into the cache at each sequence's current length. As PyTorch ops that
is ~15 small kernels per layer (position arithmetic, two rotations, index writes, casts), which a
captured decode step spends more GPU time on than on the attention itself. Here it is one.

Shapes (any strides with stride(-1) == 1):
    q        [b, s_q, h, d]               (rotated into a new contiguous q when rotary is on)
    k, v     [b, s_new, h_kv, d], [b, s_new, h_kv, d_v]
    caches   contiguous [b_cache, s_cache, h_kv, d / d_v], or paged
             [num_blocks, page_size, h_kv, d / d_v] with block_table int32 [b, max_blocks]
    seqlens  int32 [b]: rows cached per sequence before this step
    cos/sin  fp32 [n_pos, d_rot] per table (`_rope`'s form: one angle per channel)
-> (q rotated or q itself, seqlens + s_new as int32 [b])

Positions follow flash-attn's rotary rule: new key i sits at seqlens[z] + i, and so does query i
when `local` (causal or windowed attention); otherwise every query sits at seqlens[z]. New key
i goes to logical row seqlens[z] + i of its sequence: entry cache_batch_idx[z] (or z) of a
contiguous cache, or row (seqlens[z] + i) % page_size of page block_table[z, (...) // page_size].
Rows at or past the capacity are not written (callers check the capacity on the host; inside a
CUDA graph this keeps a step that would overflow from writing outside the cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import empty, next_pow2, planned
from ._launch import PlannedLaunch, call_signature, launch_planned, launch_slot
from ._rope import _geometry, _load_pairs, rotate_tile

_NUM_WARPS = 4


@triton.jit
def _copy_heads(src, dst, stride_src_h, stride_dst_h, n_heads,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Copy one token's [n_heads, HEAD_DIM] rows from src to dst (cast to dst's dtype)."""
    cols = tl.arange(0, BLOCK_D)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
        mask = (heads < n_heads)[:, None] & (cols < HEAD_DIM)[None, :]
        x = tl.load(src + heads[:, None] * stride_src_h + cols[None, :], mask=mask)
        tl.store(dst + heads[:, None] * stride_dst_h + cols[None, :], x.to(dst.dtype.element_ty),
                 mask=mask)  # fmt: skip


@triton.jit
def _rotate_heads(
    src, dst, Cos, Sin, pos, stride_table, stride_src_h, stride_dst_h, n_heads,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """RoPE of one token's [n_heads, HEAD_DIM] rows at table row `pos`, written to dst."""
    half = ROT_DIM // 2
    row = tl.full([1, 1], 1, tl.int1)
    table = tl.full([1, 1], 0, tl.int64) + pos * stride_table
    cos_a, cos_b = _load_pairs(Cos + table, row, half, BLOCK_P, INTERLEAVED)
    sin_a, sin_b = _load_pairs(Sin + table, row, half, BLOCK_P, INTERLEAVED)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
        ok = (heads < n_heads)[None, :]
        rotate_tile(
            src + heads[None, :] * stride_src_h, dst + heads[None, :] * stride_dst_h, ok,
            cos_a, cos_b, sin_a, sin_b, HEAD_DIM, ROT_DIM, BLOCK_P, BLOCK_PASS, INTERLEAVED,
        )  # fmt: skip


@triton.jit
def _rotate_append_kernel(
    Q, QOut, K, V, KCache, VCache, Seqlens, SeqlensOut, BatchIdx, BlockTable,
    QCos, QSin, KCos, KSin,
    stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_kc0, stride_kc1, stride_kch, stride_vc0, stride_vc1, stride_vch,
    stride_bt, stride_qtable, stride_ktable,
    s_q, s_new, n_heads, n_kv_heads, capacity, page_size,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, ROT_DIM: tl.constexpr,
    ROTARY: tl.constexpr, LOCAL: tl.constexpr, INTERLEAVED: tl.constexpr,
    PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Program (z, i): new key/value row i of sequence z, and query row i when rotary is on."""
    z = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    start = tl.load(Seqlens + z)
    if i == 0:
        tl.store(SeqlensOut + z, start + s_new)
    if i < s_new:
        row = (start + i).to(tl.int64)
        if row < capacity:
            if PAGED:
                page = tl.load(BlockTable + z * stride_bt + row // page_size).to(tl.int64)
                first, second = page, row % page_size
            else:
                first = tl.load(BatchIdx + z).to(tl.int64) if HAS_BATCH_IDX else z
                second = row
            k_src = K + z * stride_kb + i * stride_ks
            k_dst = KCache + first * stride_kc0 + second * stride_kc1
            if ROTARY:
                _rotate_heads(
                    k_src, k_dst, KCos, KSin, row, stride_ktable, stride_kh, stride_kch,
                    n_kv_heads, HEAD_DIM, ROT_DIM, BLOCK_HK, BLOCK_P, BLOCK_PASS, INTERLEAVED,
                )  # fmt: skip
            else:
                _copy_heads(k_src, k_dst, stride_kh, stride_kch, n_kv_heads,
                            HEAD_DIM, BLOCK_HK, BLOCK_D)  # fmt: skip
            v_src = V + z * stride_vb + i * stride_vs
            v_dst = VCache + first * stride_vc0 + second * stride_vc1
            _copy_heads(v_src, v_dst, stride_vh, stride_vch, n_kv_heads,
                        HEAD_DIM_V, BLOCK_HK, BLOCK_DV)  # fmt: skip
    if ROTARY:
        if i < s_q:
            pos = (start + i).to(tl.int64) if LOCAL else start.to(tl.int64)
            _rotate_heads(
                Q + z * stride_qb + i * stride_qs, QOut + z * stride_ob + i * stride_os,
                QCos, QSin, pos, stride_qtable, stride_qh, stride_oh,
                n_heads, HEAD_DIM, ROT_DIM, BLOCK_HQ, BLOCK_P, BLOCK_PASS, INTERLEAVED,
            )  # fmt: skip


def rotate_and_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    *,
    rotary_q: tuple[torch.Tensor, torch.Tensor] | None,
    rotary_k: tuple[torch.Tensor, torch.Tensor] | None,
    local: bool,
    interleaved: bool,
    block_table: torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (when `rotary_k` is given; `rotary_q` then too) and write k, v into the
    cache in place; see the module docstring. Assumes validated input (shapes, devices, dtypes,
    indices in range). Returns (q rotated, or q as given without rotary; seqlens + s_new int32)."""
    rotary = rotary_k is not None
    paged = block_table is not None
    seqlens = seqlens.contiguous()
    if rotary:
        (q_cos, q_sin), (k_cos, k_sin) = rotary_q, rotary_k
        q_cos, q_sin, k_cos, k_sin = (t.contiguous() for t in (q_cos, q_sin, k_cos, k_sin))
    else:
        q_cos = q_sin = k_cos = k_sin = seqlens  # never read
    table = block_table.contiguous() if paged else seqlens
    batch_idx = seqlens if cache_batch_idx is None else cache_batch_idx.contiguous()
    signature = call_signature(
        (q, k, v, k_cache, v_cache, seqlens, batch_idx, table, q_cos, q_sin, k_cos, k_sin),
        (rotary, local, interleaved, paged, cache_batch_idx is not None),
    )
    plan = planned(
        _PLANS, signature, (),
        lambda: _plan(q, k, v, k_cache, v_cache, table, q_cos, k_cos, rotary=rotary, local=local,
                      interleaved=interleaved, paged=paged, batch_idx=cache_batch_idx is not None),
    )  # fmt: skip
    seqlens_out = torch.empty(q.shape[0], dtype=torch.int32, device=q.device)
    q_out = empty(q.shape, q.dtype, q.device) if rotary else q
    launch_planned(_rotate_append_kernel, plan,
        q, q_out, k, v, k_cache, v_cache, seqlens, seqlens_out, batch_idx, table,
        q_cos, q_sin, k_cos, k_sin, *plan.ints,
        signature=signature,
    )  # fmt: skip
    return q_out, seqlens_out


# Plans by signature (`rotate_and_append`): the launch's grid, its ints after the tensors (q_out's
# strides are q's: both contiguous where rotated, the same tensor where not), its keywords and
# slot (`planned`).
_PLANS: dict[tuple, PlannedLaunch] = {}


def _plan(q, k, v, k_cache, v_cache, table, q_cos, k_cos, *, rotary, local, interleaved, paged,
          batch_idx) -> PlannedLaunch:  # fmt: skip
    """`rotate_and_append`'s launch, from the shapes and strides of its inputs."""
    b, s_q, n_heads, head_dim = q.shape
    s_new, n_kv_heads, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    capacity = table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    rot_dim = k_cos.shape[1] if rotary else 2
    _, block_hq, block_p, block_pass = _geometry(n_heads, head_dim, rot_dim)
    _, block_hk, _, _ = _geometry(n_kv_heads, head_dim, rot_dim)
    q_out_strides = q.new_empty(q.shape, device="meta").stride() if rotary else q.stride()
    ints = (
        q.stride(0), q.stride(1), q.stride(2), *q_out_strides[:3],
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        table.stride(0) if paged else 0, q_cos.stride(0), k_cos.stride(0),
        s_q, s_new, n_heads, n_kv_heads, capacity, k_cache.shape[1] if paged else 1,
    )  # fmt: skip
    kwargs = dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, ROT_DIM=rot_dim,
        ROTARY=rotary, LOCAL=local, INTERLEAVED=interleaved,
        PAGED=paged, HAS_BATCH_IDX=batch_idx,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_P=block_p, BLOCK_PASS=block_pass,
        BLOCK_D=next_pow2(head_dim), BLOCK_DV=next_pow2(head_dim_v),
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    grid = (b, max(s_new, s_q if rotary else 0, 1))
    return PlannedLaunch(grid, ints, kwargs, launch_slot())
