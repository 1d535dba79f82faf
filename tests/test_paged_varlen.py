"""`flash_attn_varlen_func(..., block_table=...)`: paged K/V for varlen attention (flash-attn
2.6's semantics) on the CPU interpreter, fp16/fp32.

Pages are shuffled, entries past a sequence's pages are -1, pages no sequence uses hold NaN.
Paged must equal contiguous exactly (the same keys reach the same kernel), pass the fp64 pass
rule of tests/attention_testing.py, and send gradients back into the pages it read. Bad tables
raise, naming the argument and the value, before anything runs.
"""

from __future__ import annotations

import pytest
import torch
from attention_testing import check_close

from fusedlayers import flash_attn_varlen_func
from fusedlayers.attention.reference import attention_reference

F16, F32 = torch.float16, torch.float32


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def make_paged(lens_q, lens_k, h, hk, d, page_size, dtype, seed=0, spare_pages=3):
    """Contiguous varlen q/k/v plus the same k/v as shuffled pages and a block table."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
    pages = [-(-n // page_size) for n in lens_k]
    num_blocks = sum(pages) + spare_pages
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_pages = torch.full((num_blocks, page_size, hk, d), float("nan"), dtype=dtype)
    v_pages = k_pages.clone()
    table = torch.full((len(lens_k), max(pages) + 1), -1, dtype=torch.int32)
    start = 0
    for z, n in enumerate(lens_k):
        for p in range(pages[z]):
            block, rows = order.pop(), slice(p * page_size, min((p + 1) * page_size, n))
            used = rows.stop - rows.start
            k_pages[block, :used] = k[start + rows.start : start + rows.stop]
            v_pages[block, :used] = v[start + rows.start : start + rows.stop]
            table[z, p] = block
        start += n
    lengths = dict(cu_q=_cu(lens_q), cu_k=_cu(lens_k), max_q=max(lens_q), max_k=max(lens_k))
    return dict(q=q, k=k, v=v, k_pages=k_pages, v_pages=v_pages, table=table, **lengths)


CASES = [
    # lens_q, lens_k, h, hk, d, page_size, dtype, causal
    ([3, 5, 1], [7, 40, 16], 4, 2, 16, 16, F16, True),
    ([6, 2], [6, 33], 2, 2, 32, 16, F32, False),
    ([4, 4, 2], [9, 4, 21], 4, 1, 16, 5, F32, True),  # a page size no kernel rule restricts
]


@pytest.mark.parametrize("lens_q,lens_k,h,hk,d,page_size,dtype,causal", CASES)
def test_paged_equals_contiguous_and_reference(lens_q, lens_k, h, hk, d, page_size, dtype, causal):
    t = make_paged(lens_q, lens_k, h, hk, d, page_size, dtype)
    common = (t["cu_q"], t["cu_k"], t["max_q"], t["max_k"])
    paged = flash_attn_varlen_func(
        t["q"], t["k_pages"], t["v_pages"], *common, causal=causal, block_table=t["table"]
    )
    flat = flash_attn_varlen_func(t["q"], t["k"], t["v"], *common, causal=causal)
    assert torch.equal(paged, flat)
    refs = {
        dt: attention_reference(
            t["q"].to(dt),
            t["k"].to(dt),
            t["v"].to(dt),
            cu_seqlens_q=t["cu_q"],
            cu_seqlens_kv=t["cu_k"],
            window_size=(-1, 0) if causal else (-1, -1),
            bottom_right=True,
        )  # fmt: skip
        for dt in (torch.float64, dtype)
    }
    check_close("out", paged, refs[torch.float64], refs[dtype], factor=2)


def test_gradients_reach_the_pages():
    t = make_paged([3, 5], [20, 17], 2, 2, 16, 16, F32, seed=1)
    k_pages = t["k_pages"].nan_to_num(0.0).requires_grad_()
    v_pages = t["v_pages"].nan_to_num(0.0).requires_grad_()
    k, v = t["k"].clone().requires_grad_(), t["v"].clone().requires_grad_()
    common = (t["cu_q"], t["cu_k"], t["max_q"], t["max_k"])
    dout = torch.randn(t["q"].shape)
    flash_attn_varlen_func(t["q"], k_pages, v_pages, *common, causal=True,
                           block_table=t["table"]).backward(dout)  # fmt: skip
    flash_attn_varlen_func(t["q"], k, v, *common, causal=True).backward(dout)
    start = 0
    for z, n in enumerate([20, 17]):
        rows = [(int(t["table"][z, j // 16]), j % 16) for j in range(n)]
        for grad_pages, grad_flat in ((k_pages.grad, k.grad), (v_pages.grad, v.grad)):
            got = torch.stack([grad_pages[p, r] for p, r in rows])
            torch.testing.assert_close(got, grad_flat[start : start + n], rtol=0, atol=0)
        start += n
    touched = {int(p) for p in t["table"].flatten() if p >= 0}
    untouched = [p for p in range(k_pages.shape[0]) if p not in touched]
    assert k_pages.grad[untouched].abs().max() == 0


def _set(name, change):
    return lambda a: a.update({name: change(a[name])})


def _entry(row, col, value):
    return lambda a: a["block_table"].__setitem__((row, col), value)


TABLE = "block_table"
BAD = [
    (_set(TABLE, lambda t: t.long()), TypeError, "block_table must be an int32"),
    (_set(TABLE, lambda t: t[0]), ValueError, "block_table must be 2-D"),
    (_set(TABLE, lambda t: t[:1]), ValueError, "1 rows but cu_seqlens_k describes 2"),
    (_entry(1, 0, 99), ValueError, r"in \[0, 7\).*got values in \[\d+, 99\]"),
    (_entry(0, 0, -1), ValueError, r"got values in \[-1,"),
    (_set(TABLE, lambda t: t[:, :1]), ValueError, "sequence 1 has 33 keys .* need 3 pages"),
    (_set("k", lambda k: k.flatten(0, 1)), ValueError, "k must be pages"),
    (_set("v", lambda v: v[:, :8]), ValueError, "must agree in num_blocks, page_size"),
]


@pytest.mark.parametrize("edit,error,match", BAD)
def test_bad_block_table_raises(edit, error, match):
    t = make_paged([2, 3], [6, 33], 2, 2, 16, 16, F32)
    a = dict(block_table=t["table"], k=t["k_pages"], v=t["v_pages"])
    edit(a)
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(t["q"], a["k"], a["v"], t["cu_q"], t["cu_k"], 3, 33,
                               block_table=a["block_table"])  # fmt: skip


def test_unused_entries_are_not_checked_and_none_is_ignored():
    t = make_paged([2, 3], [6, 33], 2, 2, 16, 16, F32)
    t["table"][0, 1:] = 1000  # past sequence 0's single page: never read
    common = (t["cu_q"], t["cu_k"], 3, 33)
    out = flash_attn_varlen_func(t["q"], t["k_pages"], t["v_pages"], *common,
                                 block_table=t["table"])  # fmt: skip
    none = flash_attn_varlen_func(t["q"], t["k"], t["v"], *common, block_table=None)
    assert torch.equal(out, none)
