"""Paged K/V for `flash_attn_varlen_func` (flash-attn 2.6's `block_table`).

Shapes: k/v pages `[num_blocks, page_size, hg, d]`, block_table int32 `[b, max_blocks]`,
cu_seqlens_k int32 `[b+1]` (n_z = cu_seqlens_k[z+1] - cu_seqlens_k[z] keys for sequence z).
Key j < n_z of sequence z is row `j % page_size` of page `block_table[z, j // page_size]`; the
table entries past a sequence's `ceil(n_z / page_size)` pages are never read (-1 is fine there).

The pages a batch uses are gathered into a contiguous varlen K/V `[t_k, hg, d]` (t_k =
cu_seqlens_k[-1]) with one indexed read per tensor, on the device, and the ordinary varlen
kernels run on it: the training kernels take no page table, and a prefill reads each key once
per query block anyway, so one more read of the keys is small beside the attention. Gradients
flow back into the pages through the gather.
"""

from __future__ import annotations

import torch

from .._host_cache import per_version
from ..errors import ArgumentError, ArgumentTypeError
from .validation import host_values


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_layout(k, v, block_table, cu_seqlens_q, cu_seqlens_k) -> tuple[int, int, list[int]]:
    """Shapes, dtypes and devices; returns (num_blocks, page_size, host cu_seqlens_k)."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            what = _describe(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ArgumentError(
                f"with block_table, {name} must be pages [num_blocks, page_size, h_k, d], got "
                f"{what}"
            )
    if k.shape[:3] != v.shape[:3]:
        raise ArgumentError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} pages must agree in num_blocks, "
            "page_size and heads"
        )
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        what = _describe(block_table) if isinstance(block_table, torch.Tensor) else block_table
        raise ArgumentTypeError(f"block_table must be an int32 tensor [b, max_blocks], got {what}")
    if block_table.dim() != 2:
        raise ArgumentError(
            f"block_table must be 2-D [b, max_blocks], got {_describe(block_table)}"
        )
    for name, t in (("k", k), ("v", v), ("cu_seqlens_k", cu_seqlens_k)):
        if isinstance(t, torch.Tensor) and t.device != block_table.device:
            raise ArgumentError(
                f"{name} is on {t.device} but block_table is on {block_table.device}"
            )
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dtype != torch.int32:
        raise ArgumentTypeError("cu_seqlens_k must be an int32 tensor [b + 1]")
    if cu_seqlens_k.dim() != 1 or cu_seqlens_k.numel() < 1:
        raise ArgumentError(f"cu_seqlens_k must be 1-D [b + 1], got {_describe(cu_seqlens_k)}")
    cu = host_values(cu_seqlens_k)  # the read the varlen front end makes anyway (memoized)
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ArgumentError(f"cu_seqlens_k must start at 0 and never decrease, got {cu[:16]}")
    b = len(cu) - 1
    if block_table.shape[0] != b:
        raise ArgumentError(
            f"block_table has {block_table.shape[0]} rows but cu_seqlens_k describes {b} "
            f"sequences ({_describe(block_table)})"
        )
    if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.numel() != b + 1:
        raise ArgumentError(
            f"cu_seqlens_q has {cu_seqlens_q.numel() - 1} sequences, cu_seqlens_k has {b}"
        )
    return k.shape[0], k.shape[1], cu


def _check_entries(block_table, pages_used: list[int], num_blocks: int) -> None:
    """Every entry a sequence uses must name a page: one read of the used entries' range per
    table version and usage (the tensor and its needs are the memo's key)."""
    if not any(pages_used):
        return

    def used_range(table: torch.Tensor) -> list[int]:
        need = torch.tensor(pages_used, device=table.device)
        used = torch.arange(table.shape[1], device=table.device) < need[:, None]
        entries = table.long()
        low = torch.where(used, entries, num_blocks).min()
        high = torch.where(used, entries, -1).max()
        return torch.stack((low, high)).tolist()

    key = f"paged_kv_used_range:{num_blocks}:{','.join(map(str, pages_used))}"
    low, high = per_version(block_table, key, used_range)
    if low < 0 or high >= num_blocks:
        raise ArgumentError(
            f"block_table entries in use must be in [0, {num_blocks}) (num_blocks = "
            f"k.shape[0]), got values in [{low}, {high}]"
        )


def gather_pages(k, v, block_table, cu_seqlens_q, cu_seqlens_k):
    """Validate a paged K/V (see the module docstring) and gather it into varlen
    `[t_k, hg, d]` K/V. Every check runs before any compute; the gather itself indexes on the
    device (its only host value is t_k, read with cu_seqlens_k)."""
    num_blocks, page_size, cu = _check_layout(k, v, block_table, cu_seqlens_q, cu_seqlens_k)
    lens = [b - a for a, b in zip(cu, cu[1:])]
    pages_used = [-(-n // page_size) for n in lens]
    for z, (n, pages) in enumerate(zip(lens, pages_used)):
        if pages > block_table.shape[1]:
            raise ArgumentError(
                f"sequence {z} has {n} keys (cu_seqlens_k), which need {pages} pages of "
                f"{page_size} rows, but block_table has {block_table.shape[1]} columns"
            )
    _check_entries(block_table, pages_used, num_blocks)
    total, b, device = cu[-1], len(lens), k.device
    starts = cu_seqlens_k.long()
    seq = torch.repeat_interleave(
        torch.arange(b, device=device), starts[1:] - starts[:-1], output_size=total
    )  # [t_k]: the sequence of every key
    j = torch.arange(total, device=device) - starts[seq]  # position within its sequence
    page = block_table.long()[seq, torch.div(j, page_size, rounding_mode="floor")]
    row = j % page_size
    return k[page, row], v[page, row]


__all__ = ["gather_pages"]
