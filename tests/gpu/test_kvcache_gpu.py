"""`flash_attn_with_kvcache` on the GPU: bf16/fp16 at decoding shapes.

b = 8, GQA 32:8, d = 128, caches of 1k-8k tokens contiguous and paged (page_size 256), plus one
32k cache; the checks of tests/kvcache_testing.py (cache rows after the append, the untouched
bytes, out/LSE against the fp64 oracle with the 2x-PyTorch rule). Then paged against
contiguous, split counts, every bad input of the CPU suite on CUDA tensors (raised before any
write), and CUDA graph captures of the kernel entry and of a whole flash_attn_with_kvcache step
(neither may sync with the host).

Run: pytest -n 4 tests/gpu/test_kvcache_gpu.py
"""

from __future__ import annotations

import re

import pytest
import torch
from fusedlayers.kernels import decode_attention
from kvcache_testing import KVCase, call_kernel, check_kv_case, make_kv_inputs
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
    check_kv_case(case, "cuda")


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_paged_matches_contiguous_gpu(dtype):
    common = dict(**DECODE, dtype=dtype, s_cache=4096, s_new=1, causal=True, seqlens="full")
    flat, paged = KVCase(**common), KVCase(**common, page_size=256)
    out_flat, lse_flat = call_kernel(flat, make_kv_inputs(flat, "cuda"))
    out_paged, lse_paged = call_kernel(paged, make_kv_inputs(paged, "cuda"))
    # The autotuner may pick another key block for each path: equal up to rounding.
    torch.testing.assert_close(out_paged, out_flat, rtol=1.6e-2, atol=4e-3)
    torch.testing.assert_close(lse_paged, lse_flat, rtol=1e-5, atol=1e-4)


def test_split_counts_agree_gpu():
    case = KVCase(**DECODE, dtype=BF16, s_cache=8192, seqlens="full")
    results = [call_kernel(case, make_kv_inputs(case, "cuda"), num_splits=n) for n in (1, 3, 0)]
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=2e-2)
        torch.testing.assert_close(lse, results[0][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case,edit,error,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_raises_before_any_write_gpu(case, edit, error, match):
    inputs = make_kv_inputs(case, "cuda")
    edit(inputs)
    caches = [inputs["k_cache"].clone(), inputs["v_cache"].clone()]
    with pytest.raises(error, match=re.escape(match)):
        call_kernel(case, inputs)
    torch.testing.assert_close(inputs["k_cache"], caches[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(inputs["v_cache"], caches[1], rtol=0, atol=0, equal_nan=True)


def test_decode_step_captures_in_a_cuda_graph():
    # The kernel entry reads lengths on the device: a captured step replays with new lengths.
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
    lens.copy_(torch.tensor([5, 2048, 17, 1500], dtype=torch.int32))
    graph.replay()
    want_out, want_lse = step()
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_front_end_step_captures_in_a_cuda_graph():
    # rotary + append + attention captured once, replayed while cache_seqlens grows in place;
    # an eager replica on cloned caches gives the same bits, cache and output.
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
