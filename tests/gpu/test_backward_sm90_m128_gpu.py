"""The sm_90 backward's d = 64 variant with 128-row query steps (`_flash_bwd_sm90.TILES_M128`)
against `attention_reference` in fp32, on an H100-class GPU.

The variant is the default d = 64 tile (`TILES[64]`; "auto" takes it from 16k keys); each case here
pins it with `TILES[64] = TILES_M128[64]` and pins the sm_90 backward, checks that the launch took
it with BLOCK_M = 128, and applies the suite's pass rule (tests/attention_testing.py), as
test_backward_sm90_gpu.py does. Cases: causal and not (both alignments), dense, right-padded,
varlen with and without gaps, MHA/GQA/MQA, lengths that are not multiples of 128 or of 64 (a step
whose second warpgroup's 64 dQ rows are all past the end, or partly), fewer queries than one
warpgroup's rows, NaN in rows no sequence owns, and agreement with the portable backward and with
itself on a long GQA problem.

Shapes: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d]; varlen [t, h, d].
"""

from __future__ import annotations

import pytest
import torch
from attention_testing import Case, check_case, make_inputs, poison_unowned_rows, run_kernel
from fusedlayers.kernels import _flash_bwd_sm90, dispatch
from test_backward_sm90_gpu import _grads, needs_sm90
from test_kernels_gpu import recorded

pytestmark = pytest.mark.gpu
DEV = "cuda"
D = 64


@pytest.fixture
def m128_spy(monkeypatch):
    """Selects the 128-row variant at d = 64, pins the sm_90 backward, and records the BLOCK_M
    of each of its launches."""
    block_ms = []
    launch = _flash_bwd_sm90.backward_sm90

    def spy(q, *args, **kwargs):
        block_ms.append(_flash_bwd_sm90.TILES[q.shape[-1]][0])
        return launch(q, *args, **kwargs)

    monkeypatch.setattr(_flash_bwd_sm90, "backward_sm90", spy)
    monkeypatch.setitem(_flash_bwd_sm90.TILES, D, _flash_bwd_sm90.TILES_M128[D])
    previous = dispatch.set_backward_path("sm90")
    yield block_ms
    dispatch.set_backward_path(previous)


CASES = [
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=2, d=D, dtype=torch.bfloat16),
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=4, d=D, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=1000, s_k=1000, h=4, h_kv=4, d=D, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=1, s_q=4096, s_k=4096, h=4, h_kv=1, d=D, dtype=torch.bfloat16, window=(-1, 0)),
    # s_q != s_k, both alignments; bottom-right with more queries than keys leaves empty rows,
    # top-left with more keys than queries leaves key blocks no query sees (dK = dV = 0).
    Case(b=2, s_q=300, s_k=777, h=8, h_kv=2, d=D, dtype=torch.float16, window=(-1, 0)),
    Case(b=2, s_q=300, s_k=777, h=8, h_kv=2, d=D, dtype=torch.bfloat16, window=(-1, 0),
         bottom_right=False),
    Case(b=2, s_q=777, s_k=300, h=8, h_kv=2, d=D, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=777, s_k=300, h=8, h_kv=2, d=D, dtype=torch.bfloat16, window=(-1, 0),
         bottom_right=False),
    # Fewer queries than one step: 97 (the second warpgroup's rows partly valid), 40 (none),
    # 1; batches large enough for one 128-row TMA box in all (fewer fall back: `tma_view`).
    Case(b=3, s_q=97, s_k=1025, h=6, h_kv=1, d=D, dtype=torch.float16),
    Case(b=4, s_q=40, s_k=200, h=2, h_kv=2, d=D, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=128, s_q=1, s_k=129, h=4, h_kv=2, d=D, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=129, s_k=65, h=2, h_kv=2, d=D, dtype=torch.bfloat16),
    # Right padding, varlen, varlen with gaps (random lengths up to the max).
    Case(b=4, s_q=700, s_k=900, h=4, h_kv=2, d=D, dtype=torch.bfloat16, layout="seqlens",
         window=(-1, 0)),
    Case(b=4, s_q=700, s_k=900, h=4, h_kv=2, d=D, dtype=torch.bfloat16, layout="seqlens"),
    Case(b=5, s_q=600, s_k=600, h=4, h_kv=4, d=D, dtype=torch.bfloat16, layout="varlen",
         window=(-1, 0)),
    Case(b=5, s_q=600, s_k=600, h=4, h_kv=2, d=D, dtype=torch.bfloat16, layout="varlen"),
    Case(b=5, s_q=513, s_k=700, h=4, h_kv=2, d=D, dtype=torch.float16, layout="varlen_padded"),
    Case(b=5, s_q=513, s_k=700, h=4, h_kv=2, d=D, dtype=torch.bfloat16, layout="varlen_padded",
         window=(-1, 0)),
]  # fmt: skip


@needs_sm90
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_sm90_m128_backward_matches_reference(case, m128_spy, request):
    with recorded(request, case.label()) as entry:
        entry["errors"] = check_case(case, DEV, high_dtype=torch.float32)
    assert m128_spy and set(m128_spy) == {128}, m128_spy


@needs_sm90
@pytest.mark.parametrize("layout", ["varlen_padded", "seqlens"])
def test_sm90_m128_backward_ignores_nan_padding(layout, m128_spy):
    """NaN in q, k, v and dout rows no sequence owns reaches no gradient (compared with the
    portable backward, which never loads them)."""
    case = Case(b=3, s_q=300, s_k=333, h=4, h_kv=2, d=D, dtype=torch.bfloat16, layout=layout,
                window=(-1, 0))  # fmt: skip
    inputs = make_inputs(case, DEV)
    poison_unowned_rows(inputs, layout, ("q", "k", "v", "dout"))
    fast = run_kernel(case, inputs)
    assert set(m128_spy) == {128}
    dispatch.set_backward_path("portable")
    portable = run_kernel(case, inputs)
    for name in ("dq", "dk", "dv"):
        assert not fast[name].isnan().any(), name
        torch.testing.assert_close(fast[name], portable[name], atol=3e-2, rtol=2e-2)


@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_m128_backward_agrees_with_portable_and_itself(causal, m128_spy):
    """One long GQA problem: dK and dV bitwise equal run to run, dQ close (fp32 reduce-adds in
    varying order), all three close to the portable backward."""
    g = torch.Generator(device=DEV).manual_seed(3)
    q, dout = (torch.randn(2, 2048, 8, D, device=DEV, generator=g).to(torch.bfloat16)
               for _ in range(2))  # fmt: skip
    k, v = (torch.randn(2, 2048, 2, D, device=DEV, generator=g).to(torch.bfloat16)
            for _ in range(2))  # fmt: skip
    first = _grads(q, k, v, dout, causal)
    second = _grads(q, k, v, dout, causal)
    assert m128_spy == [128, 128]
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    dispatch.set_backward_path("portable")
    portable = _grads(q, k, v, dout, causal)
    for fast, again, ref in zip(first, second, portable):
        for got in (fast, again):
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, err
