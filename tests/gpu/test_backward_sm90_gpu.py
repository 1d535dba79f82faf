"""The sm_90 (Hopper) backward kernel against `attention_reference` in fp32, on an H100-class GPU.

Every case pins the sm_90 backward (`set_backward_path("sm90")`) and checks that the launch
really took it (a spy on `backward_sm90`), then applies the suite's pass rule
(tests/attention_testing.py: each gradient's max error <= 3x PyTorch's own error in the input
dtype, plus one unit at the gradient's magnitude). Cases cover what the path claims: fp16/bf16,
d = 64 and 128, MHA/GQA/MQA, no mask and causal in both alignments, s_q != s_k, lengths that are
and are not multiples of the tiles, rows with no visible key, dense, right-padded, varlen with
and without gaps, strided views (sbhd, packed sb3hd) and NaN in rows no sequence owns. Further
tests: dK/dV bitwise reproducible run to run (dQ sums with atomics: close, not bitwise), agreement
with the portable backward on a long GQA problem, and the calls the path does not cover (among
them deterministic=True) falling back to the portable kernels.

Shapes: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d]; varlen [t, h, d].
"""

from __future__ import annotations

import pytest
import torch
from attention_testing import Case, check_case, make_inputs, poison_unowned_rows, run_kernel
from fusedlayers.kernels import _common, _flash_bwd_sm90, dispatch, flash_attention
from test_kernels_gpu import recorded

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _sm90_ready() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and _flash_bwd_sm90.GLUON_AVAILABLE
    )


needs_sm90 = pytest.mark.skipif(not _sm90_ready(), reason="needs an sm_90 GPU and Triton's Gluon")


@pytest.fixture
def sm90_spy(monkeypatch):
    """Pins the sm_90 backward and counts its launches."""
    calls = []
    launch = _flash_bwd_sm90.backward_sm90

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return launch(*args, **kwargs)

    monkeypatch.setattr(_flash_bwd_sm90, "backward_sm90", spy)
    previous = dispatch.set_backward_path("sm90")
    yield calls
    dispatch.set_backward_path(previous)


CASES = [
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=4, d=128, dtype=torch.bfloat16),
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=4, d=128, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=2, d=64, dtype=torch.bfloat16),
    Case(b=2, s_q=1000, s_k=1000, h=4, h_kv=4, d=64, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=1, s_q=4096, s_k=4096, h=4, h_kv=1, d=128, dtype=torch.bfloat16, window=(-1, 0)),
    # s_q != s_k, both alignments; bottom-right with more queries than keys leaves empty rows,
    # top-left with more keys than queries leaves key blocks no query sees (dK = dV = 0).
    Case(b=2, s_q=300, s_k=777, h=8, h_kv=2, d=128, dtype=torch.float16, window=(-1, 0)),
    Case(b=2, s_q=300, s_k=777, h=8, h_kv=2, d=64, dtype=torch.bfloat16, window=(-1, 0),
         bottom_right=False),
    Case(b=2, s_q=777, s_k=300, h=8, h_kv=2, d=128, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=777, s_k=300, h=8, h_kv=2, d=64, dtype=torch.bfloat16, window=(-1, 0),
         bottom_right=False),
    Case(b=3, s_q=97, s_k=1025, h=6, h_kv=1, d=64, dtype=torch.float16),
    Case(b=128, s_q=1, s_k=129, h=4, h_kv=2, d=128, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=129, s_k=65, h=2, h_kv=2, d=128, dtype=torch.bfloat16),
    # Right padding, varlen, varlen with gaps (random lengths up to the max).
    Case(b=4, s_q=700, s_k=900, h=4, h_kv=2, d=128, dtype=torch.bfloat16, layout="seqlens",
         window=(-1, 0)),
    Case(b=5, s_q=600, s_k=600, h=4, h_kv=4, d=128, dtype=torch.bfloat16, layout="varlen",
         window=(-1, 0)),
    Case(b=5, s_q=513, s_k=700, h=4, h_kv=2, d=64, dtype=torch.float16, layout="varlen_padded"),
]  # fmt: skip


@needs_sm90
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_sm90_backward_matches_reference(case, sm90_spy, request):
    with recorded(request, case.label()) as entry:
        entry["errors"] = check_case(case, DEV, high_dtype=torch.float32)
    assert sm90_spy, "the sm_90 backward did not run"


@needs_sm90
@pytest.mark.parametrize("dq_first", [False, True], ids=["dk_first", "dq_first"])
@pytest.mark.parametrize("case", [CASES[i] for i in (5, 6, 12, 14)], ids=lambda c: c.label())
def test_sm90_backward_product_orders(case, dq_first, sm90_spy, monkeypatch):
    """Both orders of a step's dK and dQ products (`DQ_BEFORE_DK`), whichever is the default for
    the head dim: GQA, both causal alignments, right padding and varlen with gaps."""
    monkeypatch.setitem(_flash_bwd_sm90.DQ_BEFORE_DK, case.d, dq_first)
    check_case(case, DEV, high_dtype=torch.float32)
    assert sm90_spy, "the sm_90 backward did not run"


@needs_sm90
@pytest.mark.parametrize("kv_heads_in_l2", [0, 2, 5])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_causal_launch_orders(kv_heads_in_l2, d, sm90_spy, monkeypatch):
    """Causal launches interleave (sequence, KV head) pairs longest-first
    (`_common.causal_order_heads`): one pair at a time (budget 0), two, and five of the six (a
    smaller last group). Every key block must still run exactly once (dK and dV are allocated
    uninitialized)."""
    case = Case(b=3, s_q=1000, s_k=1000, h=4, h_kv=2, d=d, dtype=torch.bfloat16, window=(-1, 0))
    # A pair streams its GQA group's q and dO rows: 2 query heads x 2 tensors x d x 2 bytes.
    budget = kv_heads_in_l2 * case.s_q * 2 * 2 * d * 2
    monkeypatch.setattr(_common, "CAUSAL_ORDER_L2_BYTES", budget)
    check_case(case, DEV, high_dtype=torch.float32)
    assert sm90_spy, "the sm_90 kernel did not run"


@needs_sm90
@pytest.mark.parametrize("layout", ["varlen_padded", "seqlens"])
def test_sm90_backward_ignores_nan_padding(layout, sm90_spy):
    """Rows no sequence owns may hold anything: NaN in q, k, v and dout there must not reach
    any gradient. Compared with the portable backward, which never loads them."""
    case = Case(b=3, s_q=300, s_k=333, h=4, h_kv=2, d=128, dtype=torch.bfloat16, layout=layout,
                window=(-1, 0))  # fmt: skip
    inputs = make_inputs(case, DEV)
    poison_unowned_rows(inputs, layout, ("q", "k", "v", "dout"))
    fast = run_kernel(case, inputs)
    assert sm90_spy
    dispatch.set_backward_path("portable")
    portable = run_kernel(case, inputs)
    for name in ("dq", "dk", "dv"):
        # NaN only where the inputs had it; the portable kernel leaves those rows 0.
        assert not fast[name].isnan().any(), name
        torch.testing.assert_close(fast[name], portable[name], atol=3e-2, rtol=2e-2)


def _grads(q, k, v, dout, causal):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = flash_attention(*leaves, softmax_scale=q.shape[-1] ** -0.5,
                             window_size=(-1, 0 if causal else -1))  # fmt: skip
    return torch.autograd.grad(out, leaves, dout)


@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_backward_agrees_with_portable_and_itself(d, causal, sm90_spy):
    """One long GQA problem: dK and dV bitwise equal run to run (no atomics), dQ close (fp32
    atomics in varying order), all three close to the portable backward."""
    g = torch.Generator(device=DEV).manual_seed(3)
    q, dout = (torch.randn(2, 2048, 8, d, device=DEV, generator=g).to(torch.bfloat16)
               for _ in range(2))  # fmt: skip
    k, v = (torch.randn(2, 2048, 2, d, device=DEV, generator=g).to(torch.bfloat16)
            for _ in range(2))  # fmt: skip
    first = _grads(q, k, v, dout, causal)
    second = _grads(q, k, v, dout, causal)
    assert len(sm90_spy) == 2
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    dispatch.set_backward_path("portable")
    portable = _grads(q, k, v, dout, causal)
    for fast, again, ref in zip(first, second, portable):
        for got in (fast, again):
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, err


@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_backward_strided_views(causal, sm90_spy):
    """sbhd views and packed sb3hd slices are read in place and give the gradients of the same
    inputs made contiguous (up to dQ's summation order)."""
    g = torch.Generator(device=DEV).manual_seed(7)
    s, b, h, d = 1100, 2, 4, 128
    packed = torch.randn(s, b, 3, h, d, device=DEV, generator=g).to(torch.bfloat16)
    q, k, v = (packed[:, :, i].transpose(0, 1) for i in range(3))
    dout = torch.randn(b, s, h, d, device=DEV, generator=g).to(torch.bfloat16)
    assert _flash_bwd_sm90.plan_views(q, k, v, dout, False) is not None
    strided = _grads(q, k, v, dout, causal)
    dense = _grads(q.contiguous(), k.contiguous(), v.contiguous(), dout, causal)
    assert len(sm90_spy) == 2
    torch.testing.assert_close(strided[1], dense[1], atol=0, rtol=0)
    torch.testing.assert_close(strided[2], dense[2], atol=0, rtol=0)
    torch.testing.assert_close(strided[0], dense[0], atol=2e-2, rtol=1e-2)


FALLBACK_CASES = [
    Case(b=2, s_q=300, s_k=300, h=4, d=96, dtype=torch.bfloat16),  # head dim not covered
    Case(b=2, s_q=300, s_k=300, h=4, d=128, dtype=torch.bfloat16, window=(64, 0)),
    Case(b=2, s_q=300, s_k=300, h=4, d=128, dtype=torch.bfloat16, softcap=20.0),
    Case(b=2, s_q=300, s_k=300, h=4, d=128, dtype=torch.bfloat16, alibi="batch"),
    Case(b=2, s_q=300, s_k=300, h=4, d=64, dtype=torch.bfloat16, bias="1hss"),
    Case(b=2, s_q=300, s_k=300, h=4, d=64, dtype=torch.bfloat16, dropout_p=0.1),
    Case(b=2, s_q=300, s_k=300, h=4, d=128, dtype=torch.bfloat16, deterministic=True),
    Case(b=2, s_q=300, s_k=300, h=4, d=128, d_v=64, dtype=torch.bfloat16),
    # Fewer query rows than one TMA box (2): TMA would read the memory behind q and dout.
    Case(b=2, s_q=1, s_k=513, h=4, h_kv=2, d=128, dtype=torch.bfloat16, window=(-1, 0)),
]


@needs_sm90
@pytest.mark.parametrize("case", FALLBACK_CASES, ids=lambda c: c.label())
def test_uncovered_calls_fall_back(case, sm90_spy):
    """Calls outside the sm_90 backward's coverage run the portable backward, correctly."""
    check_case(case, DEV, high_dtype=torch.float32)
    assert not sm90_spy, "the sm_90 backward ran a call it does not cover"
