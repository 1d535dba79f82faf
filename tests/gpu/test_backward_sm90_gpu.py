"""The sm_90 (Hopper) backward kernel against `attention_reference` in fp32, on an H100-class GPU.

Every case pins the sm_90 backward (`set_backward_path("sm90")`) and checks that the launch
really took it (a spy on `backward_sm90`), then applies the suite's pass rule
(tests/attention_testing.py: each gradient's max error <= 3x PyTorch's own error in the input
dtype, plus one unit at the gradient's magnitude). Cases cover what the path claims: fp16/bf16,
d = 64, 80, 96 and 128 (80 and 96 on 128-wide tiles), and the column-split schedule at 160,
192, 256 and (d_qk, d_v) = (192, 128) (256-wide tiles, 64 keys a program), MHA/GQA/MQA, no
mask and causal in both alignments, s_q != s_k, lengths that are and are not multiples of the
tiles, rows with no visible key, dense, right-padded, varlen with and without gaps, strided
views (sbhd, packed sb3hd), NaN in rows no sequence owns and (d = 80, 96, 160, 192) NaN in the
tiles' columns past d. Further tests: dK/dV bitwise reproducible run to run (dQ sums with
atomics: close, not bitwise), agreement with the portable backward on a long GQA problem, and
the calls the path does not cover (among them deterministic=True) falling back to the
portable kernels, and the wide schedule's variants (`WIDE_VARIANTS`) each flipped from the
dims' default (`WIDE_DEFAULTS`) on a few cases: off where it runs, on where it fits and does not.

Shapes: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d]; varlen [t, h, d].
"""

from __future__ import annotations

import pytest
import torch
from attention_testing import (
    Case,
    check_case,
    check_results,
    make_inputs,
    poison_unowned_rows,
    run_kernel,
    run_reference,
)
from fusedlayers.kernels import _common, _flash_bwd_sm90, dispatch, flash_attention
from fusedlayers.kernels._flash_bwd import flash_attention_backward
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
        calls.append({**kwargs, "args": args})
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
    # d = 80 and 96 on d = 128's 128-wide tiles (`_flash_bwd_sm90.tile_width`): their columns
    # past d read the next head's data or TMA's zero fill. MHA, GQA, MQA-like groups (one KV
    # head of 80 or 96 columns is narrower than the box: those take the portable backward,
    # FALLBACK_CASES), both alignments with s_q != s_k, odd lengths, one-query rows, padding.
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=4, d=96, dtype=torch.bfloat16),
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=4, d=80, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=1, s_q=4096, s_k=4096, h=8, h_kv=2, d=96, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=300, s_k=777, h=8, h_kv=2, d=96, dtype=torch.float16, window=(-1, 0)),
    Case(b=2, s_q=300, s_k=777, h=8, h_kv=2, d=80, dtype=torch.bfloat16, window=(-1, 0),
         bottom_right=False),
    Case(b=2, s_q=777, s_k=300, h=8, h_kv=2, d=80, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=777, s_k=300, h=8, h_kv=2, d=96, dtype=torch.bfloat16, window=(-1, 0),
         bottom_right=False),
    Case(b=3, s_q=97, s_k=1025, h=6, h_kv=2, d=96, dtype=torch.float16),
    Case(b=3, s_q=1025, s_k=97, h=6, h_kv=3, d=80, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=128, s_q=1, s_k=129, h=4, h_kv=2, d=96, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=129, s_k=65, h=2, h_kv=2, d=80, dtype=torch.float16),
    Case(b=4, s_q=700, s_k=900, h=4, h_kv=2, d=96, dtype=torch.bfloat16, layout="seqlens",
         window=(-1, 0)),
    Case(b=5, s_q=600, s_k=600, h=4, h_kv=4, d=80, dtype=torch.bfloat16, layout="varlen",
         window=(-1, 0)),
    Case(b=5, s_q=513, s_k=700, h=4, h_kv=2, d=96, dtype=torch.float16, layout="varlen_padded"),
    Case(b=5, s_q=513, s_k=700, h=4, h_kv=2, d=80, dtype=torch.bfloat16, layout="varlen_padded",
         window=(-1, 0), bottom_right=False),
    # d = 192, 256 and (192, 128) (`_flash_bwd_sm90_wide`): the d = 128 cases again, and one
    # query head per KV head of 192 columns (rows 192 wide: narrower than the box, FALLBACK).
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=4, d=256, dtype=torch.bfloat16),
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=4, d=192, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=2, d=192, d_v=128, dtype=torch.bfloat16),
    Case(b=1, s_q=4096, s_k=4096, h=4, h_kv=2, d=256, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=300, s_k=777, h=8, h_kv=2, d=256, dtype=torch.float16, window=(-1, 0)),
    Case(b=2, s_q=300, s_k=777, h=8, h_kv=2, d=192, dtype=torch.bfloat16, window=(-1, 0),
         bottom_right=False),
    Case(b=2, s_q=777, s_k=300, h=8, h_kv=2, d=192, d_v=128, dtype=torch.bfloat16,
         window=(-1, 0)),
    Case(b=2, s_q=777, s_k=300, h=8, h_kv=2, d=256, dtype=torch.bfloat16, window=(-1, 0),
         bottom_right=False),
    Case(b=3, s_q=97, s_k=1025, h=6, h_kv=2, d=256, dtype=torch.float16),
    Case(b=3, s_q=1025, s_k=97, h=6, h_kv=3, d=192, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=128, s_q=1, s_k=129, h=4, h_kv=2, d=256, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=129, s_k=65, h=2, h_kv=2, d=192, dtype=torch.float16),
    Case(b=4, s_q=700, s_k=900, h=4, h_kv=2, d=256, dtype=torch.bfloat16, layout="seqlens",
         window=(-1, 0)),
    Case(b=5, s_q=600, s_k=600, h=4, h_kv=4, d=192, dtype=torch.bfloat16, layout="varlen",
         window=(-1, 0)),
    Case(b=5, s_q=513, s_k=700, h=4, h_kv=2, d=256, dtype=torch.float16, layout="varlen_padded"),
    Case(b=5, s_q=513, s_k=700, h=4, h_kv=2, d=192, d_v=128, dtype=torch.bfloat16,
         layout="varlen_padded", window=(-1, 0), bottom_right=False),
    # d = 160 on the same 256-wide tiles (96 columns past d). The wide cases run each dims'
    # default variants (`WIDE_DEFAULTS`: the split ring at (192, 128), dV before dS^T at 160
    # and 192), no mask and causal at each of 160, 192, 256 and (192, 128).
    Case(b=2, s_q=1024, s_k=1024, h=4, h_kv=2, d=160, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=300, s_k=777, h=8, h_kv=2, d=160, dtype=torch.float16),
    Case(b=5, s_q=513, s_k=700, h=4, h_kv=2, d=160, dtype=torch.bfloat16, layout="varlen_padded",
         window=(-1, 0), bottom_right=False),
]  # fmt: skip


@needs_sm90
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_sm90_backward_matches_reference(case, sm90_spy, request):
    with recorded(request, case.label()) as entry:
        entry["errors"] = check_case(case, DEV, high_dtype=torch.float32)
    assert sm90_spy, "the sm_90 backward did not run"


@needs_sm90
@pytest.mark.parametrize("dq_first", [False, True], ids=["dk_first", "dq_first"])
@pytest.mark.parametrize(
    "case", [CASES[i] for i in (5, 6, 12, 14, 19, 26, 29)], ids=lambda c: c.label()
)
def test_sm90_backward_product_orders(case, dq_first, sm90_spy, monkeypatch):
    """Both orders of a step's dK and dQ products (`DQ_BEFORE_DK`, per tile width), whichever
    is the default for the head dim: GQA, both causal alignments, right padding and varlen with
    gaps, at d = 80 and 96 too."""
    width = _flash_bwd_sm90.tile_width(case.d)
    monkeypatch.setitem(_flash_bwd_sm90.DQ_BEFORE_DK, width, dq_first)
    check_case(case, DEV, high_dtype=torch.float32)
    assert sm90_spy, "the sm_90 backward did not run"


# The wide schedule's variants (`_flash_bwd_sm90.WIDE_VARIANTS`) on a few of its cases: no
# mask and causal (both alignments), MHA and GQA, s_q != s_k, odd lengths, varlen with and
# without gaps, at d = 160, 192, 256 and (192, 128) (a selection of `CASES`).
WIDE_VARIANT_CASES = [CASES[i] for i in (30, 33, 31, 32, 36, 43, 44, 45, 46, 47)]


@needs_sm90
@pytest.mark.parametrize("variant", list(_flash_bwd_sm90.WIDE_VARIANTS))
@pytest.mark.parametrize("case", WIDE_VARIANT_CASES, ids=lambda c: c.label())
def test_sm90_backward_wide_variants_flipped(case, variant, sm90_spy, monkeypatch):
    """Each of the wide schedule's variants flipped from the dims' default (`WIDE_DEFAULTS`)
    against the reference: turned off where the dims run it (the split ring at (192, 128), dV
    before dS^T at 160 and 192: the schedule they replaced stays selectable), turned on where it
    fits (`wide_variant_fits`) and they do not (dV before dS^T at 256, and beside the split ring
    at (192, 128)); the split ring at 160-256 does not fit shared memory."""
    dims = (case.d, case.d if case.d_v is None else case.d_v)
    on = _flash_bwd_sm90.WIDE_DEFAULTS[dims]
    if variant in on:
        flipped = tuple(name for name in on if name != variant)
    elif _flash_bwd_sm90.wide_variant_fits(variant, *dims):
        flipped = (*on, variant)
    else:
        pytest.skip(f"{variant} does not fit shared memory at {dims[0]}/{dims[1]}")
    monkeypatch.setitem(_flash_bwd_sm90.WIDE_DEFAULTS, dims, flipped)
    check_case(case, DEV, high_dtype=torch.float32)
    assert sm90_spy, "the sm_90 backward did not run"


@needs_sm90
@pytest.mark.parametrize("kv_heads_in_l2", [0, 2, 5])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
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
@pytest.mark.parametrize("d", [128, 80, 256, 192])
@pytest.mark.parametrize("layout", ["varlen_padded", "seqlens"])
def test_sm90_backward_ignores_nan_padding(layout, d, sm90_spy):
    """Rows no sequence owns may hold anything: NaN in q, k, v and dout there must not reach
    any gradient. Compared with the portable backward, which never loads them."""
    case = Case(b=3, s_q=300, s_k=333, h=4, h_kv=2, d=d, dtype=torch.bfloat16, layout=layout,
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
@pytest.mark.parametrize("d", [64, 96, 128, 160, 192, 256])
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


@needs_sm90
@pytest.mark.parametrize("causal", [False, True], ids=["no_mask", "causal"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
@pytest.mark.parametrize("d", [80, 96, 160, 192])
def test_sm90_backward_narrow_head_dims_ignore_the_columns_past_them(d, layout, causal, sm90_spy):
    """d = 80 and 96 read 128-wide tiles of q, k, v and dout, d = 192 256-wide ones: the columns
    past d (here NaN: all four are views of buffers twice the tile width a head, and dout
    reaches the kernel as such a view, called
    directly) must enter neither the scores nor a stored dK / dV column, and the dQ
    accumulator's padding columns (where the NaN of dS K's extra columns land) must not reach
    dq. Judged by the file's rule against the reference on the same values."""
    case = Case(b=2, s_q=700, s_k=900, h=4, h_kv=2, d=d, dtype=torch.bfloat16, layout=layout,
                window=(-1, 0) if causal else (-1, -1))  # fmt: skip
    inputs = make_inputs(case, DEV)
    buffer = 2 * _flash_bwd_sm90.tile_width(d)
    for name in ("q", "k", "v", "dout"):
        t = inputs[name]
        wide = torch.full((*t.shape[:-1], buffer), float("nan"), dtype=case.dtype,
                          device=t.device)  # fmt: skip
        wide[..., :d] = t
        inputs[name] = wide[..., :d]
    kernel = run_kernel(case, inputs, backward=False)  # the forward: out and LSE
    meta = {k: inputs[k] for k in inputs if ("seqlen" in k or "offsets" in k)}
    dq, dk, dv, _ = flash_attention_backward(
        inputs["dout"], inputs["q"], inputs["k"], inputs["v"], kernel["out"], kernel["lse"],
        **meta, softmax_scale=case.scale, window_right=case.window[1],
        bottom_right=case.bottom_right,
    )  # fmt: skip
    assert len(sm90_spy) == 1, "the sm_90 backward did not run"
    assert sm90_spy[0]["args"][3].stride(-2) == buffer  # dout's NaN columns reached the kernel
    kernel.update(dq=dq, dk=dk, dv=dv)
    high = run_reference(case, inputs, torch.float32)
    low = run_reference(case, inputs, case.dtype)
    for name in ("dq", "dk", "dv"):
        assert not kernel[name].isnan().any(), name
    check_results(kernel, high, low, case.s_k)


FALLBACK_CASES = [
    Case(b=2, s_q=300, s_k=300, h=4, d=112, dtype=torch.bfloat16),  # head dim not covered
    # One KV head of d = 96 in rows 96 wide: narrower than the tile's 128-wide TMA box; of 192
    # in rows 192 wide, narrower than the 256-wide one.
    Case(b=2, s_q=300, s_k=300, h=4, h_kv=1, d=96, dtype=torch.bfloat16, window=(-1, 0)),
    Case(b=2, s_q=300, s_k=300, h=4, h_kv=1, d=192, dtype=torch.bfloat16, window=(-1, 0)),
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


@needs_sm90
@pytest.mark.parametrize("d_qk, d_v", [(160, 160), (192, 192), (256, 256), (192, 128)])
def test_auto_takes_the_sm90_backward_at_wide_head_dims(d_qk, d_v, sm90_spy):
    """Under "auto" the 256-wide schedule runs d = 160-256 and (192, 128) from
    `dispatch.SM90_BWD_MIN_KEYS` keys (1,024), and a call under the length keeps the portable
    backward (non-causal launches above d = 128 want no minimum of waves)."""
    dispatch.set_backward_path("auto")
    case = Case(b=2, s_q=4096, s_k=4096, h=8, h_kv=8, d=d_qk, d_v=d_v, dtype=torch.bfloat16)
    check_case(case, DEV, high_dtype=torch.float32)
    assert sm90_spy, "auto did not take the sm_90 backward"
    sm90_spy.clear()
    short = Case(b=2, s_q=512, s_k=512, h=8, h_kv=8, d=d_qk, d_v=d_v, dtype=torch.bfloat16)
    check_case(short, DEV, high_dtype=torch.float32)
    assert not sm90_spy, "auto took the sm_90 backward under its length threshold"
