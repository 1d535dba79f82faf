"""`flash_attn_with_kvcache` on the GPU: bf16/fp16 at decoding shapes.

b = 8, GQA 32:8, d = 128, caches of 1k-8k tokens contiguous and paged (page_size 256), plus one
32k cache; the checks of tests/kvcache_testing.py (cache rows after the append, the untouched
bytes, out/LSE against the fp64 oracle with the 2x-PyTorch rule), the paged ones also with the
pages read just before their K/V loads (`PAGE_PREFETCH` off). Then paged against contiguous,
split counts, every bad input of the CPU suite on CUDA tensors (raised before any write), and
CUDA graph captures of the kernel entry and of a whole flash_attn_with_kvcache step (neither
may sync with the host). The reference cases run the default merge; split counts and capture
run with both (`COMBINES`: in the main launch's last program per tile, or a second launch); the
fused merge is also repeated many times against its own first result (a merge that read a
partial before it landed would differ) and captured before any eager fused call (it must fall
back to the second launch).

Run: pytest -n 4 tests/gpu/test_kvcache_gpu.py
"""

from __future__ import annotations

import re

import pytest
import torch
from fusedlayers.kernels import _decode_merge, _flash_decode, decode_attention
from kvcache_testing import (
    COMBINES,
    KVCase,
    call_kernel,
    check_kv_case,
    make_kv_inputs,
    pin_combine,
    tickets_all_zero,
)
from test_kvcache import BAD

from fusedlayers import flash_attn_with_kvcache

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
DECODE = dict(b=8, h=32, hk=8, d=128)

CASES = [
    KVCase(**DECODE, dtype=dtype, s_cache=s_cache, s_new=1, causal=True, page_size=page)
    for dtype in (BF16, F16)
    for s_cache in (1024, 8192)
    for page in (None, 256)
] + [
    KVCase(**DECODE, dtype=BF16, s_cache=2048, s_q=4, s_new=4, causal=True, rotary="interleaved"),
    KVCase(**DECODE, dtype=F16, s_cache=2048, s_q=2, s_new=2, rotary="half", rotary_dim=64),
    KVCase(**DECODE, dtype=BF16, s_cache=2048, s_new=1, leftpad=True, page_size=256, causal=True),
    KVCase(**DECODE, dtype=F16, s_cache=2048, s_q=3, s_new=3, batch_idx=True, causal=True),
    KVCase(**DECODE, dtype=BF16, s_cache=4096, s_q=4, s_new=4, window=(512, 0), page_size=256),
    KVCase(**DECODE, dtype=F16, s_cache=2048, s_new=1, softcap=30.0, causal=True),
    KVCase(**DECODE, dtype=BF16, s_cache=2048, s_q=2, s_new=2, alibi=True, causal=True),
    KVCase(**DECODE, dtype=BF16, s_cache=2048, seqlens="zero", s_q=2, s_new=2, causal=True),
    KVCase(**DECODE, dtype=F16, s_cache=2048, s_new=1, num_splits=1, causal=True),
    KVCase(b=2, h=32, hk=8, d=128, dtype=BF16, s_cache=32768, s_new=1, causal=True, page_size=256),
    KVCase(b=4, h=16, hk=2, d=64, dtype=F16, s_cache=1024, s_new=1, causal=True),
    KVCase(b=4, h=8, hk=2, d=256, dtype=BF16, s_cache=1024, s_new=2, s_q=2, causal=True),
    KVCase(b=4, h=8, hk=2, d=128, dtype=F16, s_cache=1024, s_new=1, page_size=16, causal=True),
    KVCase(b=2, h=32, hk=1, d=128, dtype=BF16, s_cache=2048, s_q=4, s_new=4, causal=True),  # MQA
    KVCase(b=3, h=12, hk=4, d=96, dtype=F16, s_cache=1536, s_new=1, causal=True, page_size=512),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_matches_reference_gpu(case):
    # The default merge (fused where it fits one load); the tests below run both merges.
    check_kv_case(case, "cuda")
    assert tickets_all_zero()


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.page_size], ids=lambda c: c.label() + "-table-inline"
)
def test_paged_without_page_prefetch_matches_reference_gpu(case, monkeypatch):
    """The paged path with each block's page loaded just before its K/V (the setting kept for
    timing against the default, which loads it a block ahead: `_flash_decode.PAGE_PREFETCH`)."""
    monkeypatch.setattr(_flash_decode, "PAGE_PREFETCH", False)
    check_kv_case(case, "cuda")
    assert tickets_all_zero()


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_paged_matches_contiguous_gpu(dtype):
    common = dict(**DECODE, dtype=dtype, s_cache=4096, s_new=1, causal=True, seqlens="full")
    flat, paged = KVCase(**common), KVCase(**common, page_size=256)
    out_flat, lse_flat = call_kernel(flat, make_kv_inputs(flat, "cuda"))
    out_paged, lse_paged = call_kernel(paged, make_kv_inputs(paged, "cuda"))
    # The autotuner may pick another key block for each path: equal up to rounding.
    torch.testing.assert_close(out_paged, out_flat, rtol=1.6e-2, atol=4e-3)
    torch.testing.assert_close(lse_paged, lse_flat, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("combine", COMBINES)
def test_split_counts_agree_gpu(combine, monkeypatch):
    merges = pin_combine(monkeypatch, combine)
    case = KVCase(**DECODE, dtype=BF16, s_cache=8192, seqlens="full")
    splits = (1, 3, 0, 64)
    results = [call_kernel(case, make_kv_inputs(case, "cuda"), num_splits=n) for n in splits]
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=2e-2)
        torch.testing.assert_close(lse, results[0][1], rtol=1e-5, atol=1e-5)
    # Fused, the 64-split call's merge (4 rows x 64 splits x d 128) is too large for one load
    # and takes the second launch (`_decode_merge._fuses_merge`); 3 splits and the heuristic's
    # 2 merge in the main launch.
    assert len(merges) == (1 if combine == "fused" else 3) and tickets_all_zero()


@pytest.mark.parametrize(
    "b,h,hk,d,s_cache,page,num_splits",
    [
        (1, 32, 8, 128, 8192, None, 16),  # the one-wave pick at b = 1: the largest fused load
        (1, 32, 8, 128, 8192, 256, 16),  # paged, each split two pages
        (3, 48, 8, 128, 4096, None, 8),  # 6 query heads a KV head, ragged lengths
        (1, 8, 8, 128, 2048, None, 64),  # MHA: one row a tile, 64 splits
        (2, 4, 4, 256, 2048, None, 32),  # d = 256
    ],
)
def test_fused_merge_repeats_bitwise_gpu(b, h, hk, d, s_cache, page, num_splits, monkeypatch):
    """The fused merge reads the partials in a fixed order, so every call on the same inputs
    gives the same bits; a merge that ran before some split's partial reached memory would not.
    Many calls back to back (and random lengths, so splits finish at different times), then the
    separate merge as the reference."""
    case = KVCase(b=b, h=h, hk=hk, d=d, dtype=BF16, s_cache=s_cache, page_size=page,
                  num_splits=num_splits)  # fmt: skip
    inputs = make_kv_inputs(case, "cuda")
    merges = pin_combine(monkeypatch, "fused")
    first = call_kernel(case, inputs)
    assert merges == []  # merged in the main launch
    for _ in range(300):
        out, lse = call_kernel(case, inputs)
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1])
    assert tickets_all_zero()
    pin_combine(monkeypatch, "separate")
    out, lse = call_kernel(case, inputs)
    torch.testing.assert_close(first[0], out, rtol=0, atol=1e-2)
    torch.testing.assert_close(first[1], lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case,edit,error,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_raises_before_any_write_gpu(case, edit, error, match):
    inputs = make_kv_inputs(case, "cuda")
    edit(inputs)
    caches = [inputs["k_cache"].clone(), inputs["v_cache"].clone()]
    with pytest.raises(error, match=re.escape(match)):
        call_kernel(case, inputs)
    torch.testing.assert_close(inputs["k_cache"], caches[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(inputs["v_cache"], caches[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("combine", COMBINES)
def test_decode_step_captures_in_a_cuda_graph(combine, monkeypatch):
    # The kernel entry reads lengths on the device: a captured step replays with new lengths.
    # Fused: the graph replays on the counters the warm-up made, which each replay leaves at 0.
    pin_combine(monkeypatch, combine)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, hk, d = 4, 2048, 8, 128
    q = torch.randn(b, 1, 32, d, device="cuda", dtype=BF16, generator=g)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=BF16, generator=g)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=BF16, generator=g)
    lens = torch.full((b,), 1000, dtype=torch.int32, device="cuda")

    def step():
        return decode_attention(q, k, v, lens, softmax_scale=d**-0.5, window_right=0)

    step()  # autotune and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for new_lens in ([5, 2048, 17, 1500], [2048, 1, 0, 999]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        graph.replay()
        want_out, want_lse = step()
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert tickets_all_zero()


def test_capture_before_any_fused_call_gpu(monkeypatch):
    """A split call captured while this device has no counters yet (its warm-up ran with the
    separate merge): no buffer is made under capture, the captured call merges in a second
    launch, and the first eager fused call afterwards makes the counters."""
    monkeypatch.setattr(_decode_merge, "_TICKETS", {})
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, hk, d = 2, 4096, 8, 128
    q = torch.randn(b, 1, 32, d, device="cuda", dtype=BF16, generator=g)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=BF16, generator=g)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=BF16, generator=g)
    lens = torch.tensor([4000, 77], dtype=torch.int32, device="cuda")

    def step():
        return decode_attention(q, k, v, lens, softmax_scale=d**-0.5, num_splits=8)

    pin_combine(monkeypatch, "separate")
    want = step()  # compiles the separate merge outside the capture
    torch.cuda.synchronize()
    merges = pin_combine(monkeypatch, "fused")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    assert _decode_merge._TICKETS == {} and len(merges) == 1
    graph.replay()
    torch.testing.assert_close(out, want[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, want[1], rtol=0, atol=0)
    fused = step()
    assert torch.device("cuda", torch.cuda.current_device()) in _decode_merge._TICKETS
    torch.testing.assert_close(fused[0], want[0], rtol=0, atol=1e-2)
    torch.testing.assert_close(fused[1], want[1], rtol=1e-5, atol=1e-5)
    assert tickets_all_zero()


@pytest.mark.parametrize("combine", COMBINES)
def test_front_end_step_captures_in_a_cuda_graph(combine, monkeypatch):
    # rotary + append + attention captured once, replayed while cache_seqlens grows in place;
    # an eager replica on cloned caches gives the same bits, cache and output.
    pin_combine(monkeypatch, combine)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, hk, d = 4, 1024, 8, 128

    def randn(*shape):
        return torch.randn(shape, device="cuda", dtype=BF16, generator=g)

    q, k_new, v_new = randn(b, 1, 32, d), randn(b, 1, hk, d), randn(b, 1, hk, d)
    k_cache, v_cache = randn(b, s, hk, d), randn(b, s, hk, d)
    angle = torch.rand(s, d // 2, device="cuda", generator=g) * 6.28
    cos, sin = angle.cos().to(BF16), angle.sin().to(BF16)
    lens = torch.tensor([10, 100, 500, 1000], dtype=torch.int32, device="cuda")

    def step(kc, vc):
        return flash_attn_with_kvcache(
            q, kc, vc, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
            causal=True,
        )  # fmt: skip

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    step(k_cache.clone(), v_cache.clone())  # autotune and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(k_cache, v_cache)
    for _ in range(3):
        for t in (q, k_new, v_new):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g))
        graph.replay()
        want = step(k_ref, v_ref)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        lens += 1
