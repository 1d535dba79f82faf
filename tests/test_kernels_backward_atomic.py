"""The atomic-dQ backward (deterministic=False) under the Triton interpreter, against fp64 autograd.

Where `ATOMIC_DQ_DEVICES` enables it (off by default until measured on the H100), a
non-deterministic backward folds dQ into the dK/dV kernel (fp32 atomics into a zero-filled
accumulator, FlashAttention-2's scheme). The `atomic` fixture sets it to "any" so these tests run
the atomic kernel under the interpreter; a spy on the two kernels checks which scheme each call
really ran.

Pass rule: `attention_testing`'s (kernel error at most 3x PyTorch's own error in the input dtype
for gradients, 2x for out/LSE), fp16/fp32 only (the interpreter's bf16 dot is broken). Layouts:
dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d(_v)]; varlen q [t_q, h, d]; lse dense [b, h, s_q] /
varlen [h, t_q].
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_testing import Case, KernelSpy, check_case, make_inputs, run_kernel
from fusedlayers.kernels import _flash_bwd
from fusedlayers.kernels._flash_bwd import flash_attention_backward

from fusedlayers.attention.reference import attention_reference

F16, F32 = torch.float16, torch.float32
CAUSAL = (-1, 0)


@pytest.fixture
def spies(monkeypatch) -> dict[str, KernelSpy]:
    """Spies on the launcher's dK/dV and dQ kernels (module globals, looked up per call)."""
    found = {}
    for name, attr in (("dkdv", "_flash_bwd_dkdv_kernel"), ("dq", "_flash_bwd_dq_kernel")):
        found[name] = KernelSpy(getattr(_flash_bwd, attr))
        monkeypatch.setattr(_flash_bwd, attr, found[name])
    return found


@pytest.fixture
def atomic(monkeypatch, spies) -> dict[str, KernelSpy]:
    """Let deterministic=False take the atomic path on the interpreter too."""
    monkeypatch.setattr(_flash_bwd, "ATOMIC_DQ_DEVICES", "any")
    return spies


def _ran_atomic(spies: dict[str, KernelSpy]) -> bool:
    """True when every backward since the last reset was the single atomic launch."""
    dkdv = [launch["ATOMIC_DQ"] for launch in spies["dkdv"].launches]
    atomic = bool(dkdv) and all(dkdv) and not spies["dq"].launches
    two_pass = bool(dkdv) and not any(dkdv) and len(spies["dq"].launches) == len(dkdv)
    assert atomic or two_pass, f"mixed launches: dkdv {dkdv}, dq {len(spies['dq'].launches)}"
    return atomic


# Each feature the atomic path must carry into dQ, on shapes spanning several 16-wide blocks
# with ragged edges (the interpreter's backward tiles are 16 x 16).
CASES = [
    Case(h=2, h_kv=2, s_q=23, s_k=37),
    Case(h=4, h_kv=2, s_q=20, s_k=33, window=CAUSAL),
    Case(h=2, h_kv=1, s_q=33, s_k=20, window=CAUSAL, bottom_right=False, dtype=F32, b=1),
    Case(h=4, h_kv=1, s_q=34, s_k=41, window=(5, 3)),
    Case(layout="varlen_padded", b=3, s_q=17, s_k=19, h=4, h_kv=2, window=CAUSAL),
    Case(layout="seqlens", b=2, s_q=18, s_k=21, window=CAUSAL, bottom_right=False, dtype=F32),
    Case(softcap=3.0, s_q=20, s_k=25, window=CAUSAL),
    Case(alibi="batch", h=4, h_kv=2, s_q=19, s_k=21, window=(7, -1)),
    Case(dropout_p=0.25, h=2, h_kv=1, s_q=20, s_k=24, window=(8, 0)),
    Case(d=40, d_v=24, s_q=21, s_k=18, dtype=F32, b=1),
]


@pytest.mark.parametrize("case", CASES, ids=[c.label() for c in CASES])
def test_atomic_path_matches_reference(case, device, atomic):
    check_case(case, device)
    assert _ran_atomic(atomic)


def test_atomic_path_with_a_bias_that_needs_no_gradient(atomic):
    """A bias without requires_grad keeps the atomic path; the result matches fp64 autograd."""
    g = torch.Generator().manual_seed(21)
    q, k, v, dout = (torch.randn(1, n, 2, 16, generator=g) for n in (20, 27, 27, 20))
    bias = torch.randn(1, 2, 20, 27, generator=g)
    ref = dict(softmax_scale=0.25, window_size=CAUSAL, bias=bias)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    high = torch.autograd.grad(attention_reference(*leaves, **ref), leaves, dout.double())
    low_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*low_leaves, **ref, return_lse=True)
    low = torch.autograd.grad(out, low_leaves, dout)
    got = flash_attention_backward(
        dout, q, k, v, out.detach(), lse, softmax_scale=0.25, window_right=0, bias=bias
    )
    assert _ran_atomic(atomic) and got[3] is None
    for name, value, h, lo in zip(("dq", "dk", "dv"), got, high, low):
        error, pytorch_error = (value.double() - h).abs().max(), (lo.double() - h).abs().max()
        assert error <= 3 * pytorch_error + 4 * torch.finfo(F32).eps, name


@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
def test_both_paths_agree(dtype, device, atomic):
    """Same inputs: dK/dV bitwise equal (same kernel code), dQ equal up to summation order."""
    case = Case(h=4, h_kv=2, s_q=37, s_k=29, window=(9, 2), dtype=dtype, softcap=4.0)
    inputs = make_inputs(case, device)
    fast = run_kernel(case, inputs)
    assert _ran_atomic(atomic)
    for spy in atomic.values():
        spy.launches.clear()
    exact = run_kernel(dataclasses.replace(case, deterministic=True), inputs)
    assert not _ran_atomic(atomic)
    for name in ("out", "lse", "dk", "dv"):
        assert torch.equal(fast[name], exact[name]), name
    # fp16: the two-pass kernel rounds an fp32 sum of the same products; one unit of fp16 apart.
    atol = 2e-3 if dtype == F16 else 1e-5
    torch.testing.assert_close(fast["dq"], exact["dq"], rtol=1e-3, atol=atol)


def test_empty_key_sequence_keeps_zero_dq(device, atomic):
    """No program adds to the dQ rows of a sequence without keys: they stay 0, no NaN; the rest
    matches the two-pass scheme (the reference cannot take an empty key sequence)."""
    case = Case(layout="varlen_padded", b=2, s_q=18, s_k=20, h=2, h_kv=1, empty_k=True)
    inputs = make_inputs(case, device)
    fast = run_kernel(case, inputs)
    assert _ran_atomic(atomic)
    exact = run_kernel(dataclasses.replace(case, deterministic=True), inputs)
    start = inputs["seq_offsets_q"][1].item()
    end = start + inputs["cu_seqlens_q"].diff()[1].item()
    assert not fast["dq"].isnan().any() and (fast["dq"][start:end] == 0).all()
    torch.testing.assert_close(fast["dq"], exact["dq"], rtol=1e-3, atol=2e-3)


def test_deterministic_or_dbias_keeps_the_two_pass_path(device, atomic):
    """deterministic=True never launches the atomic kernel, nor does a requested dBias."""
    for case in (
        Case(s_q=18, s_k=20, window=CAUSAL, deterministic=True),
        Case(s_q=18, s_k=20, bias="1hss"),
    ):
        check_case(case, device)
        assert not _ran_atomic(atomic), case.label()
        for spy in atomic.values():
            spy.launches.clear()


@pytest.mark.parametrize("setting", ["never", "cuda"])
def test_default_and_cuda_only_settings_keep_cpu_on_two_passes(spies, monkeypatch, setting):
    """The default ("never", until measured on the H100) and "cuda" both keep deterministic=False
    on the two-pass scheme for CPU tensors."""
    if setting == "never":
        assert _flash_bwd.ATOMIC_DQ_DEVICES == "never"
    monkeypatch.setattr(_flash_bwd, "ATOMIC_DQ_DEVICES", setting)
    case = Case(s_q=17, s_k=17)
    run_kernel(case, make_inputs(case, "cpu"))
    assert not _ran_atomic(spies)


@pytest.mark.parametrize(
    "case, fills",
    [
        # Every row belongs to a sequence: the preprocess zeroes the accumulator.
        (Case(b=2, h=4, h_kv=2, s_q=23, s_k=37, d=40, d_v=24, dtype=F32, window=CAUSAL), False),
        (Case(b=1, h=2, h_kv=1, s_q=70, s_k=30), False),
        # Rows no program may visit (padding; varlen tokens past cu_seqlens[-1], which the
        # host does not read): the launcher hands over a zero-filled one.
        (Case(layout="seqlens", b=2, s_q=18, s_k=21, window=CAUSAL, dtype=F32), True),
        (Case(layout="varlen", b=3, s_q=17, s_k=19, h=2, h_kv=1, window=CAUSAL), True),
    ],
    ids=["dense-d40-dv24", "dense-70-rows", "seqlens", "varlen"],
)
def test_preprocess_zeroes_the_dq_accumulator(case, fills, atomic, monkeypatch):
    """The atomic schemes sum dQ into an fp32 accumulator that must start at 0. Where the plan
    leaves that to the preprocess, the accumulator arrives NaN-filled here, so any row it
    missed makes dq NaN and fails the comparison with fp64 autograd."""
    sm90 = _flash_bwd.sm90_kernels("_flash_bwd_sm90")
    real = sm90.dq_accumulator
    asked = []

    def nan_unless_zeroed(q, zeroed=True, width=None):
        asked.append(zeroed)
        acc = real(q, zeroed=zeroed, width=width)
        return acc if zeroed else acc.fill_(float("nan"))

    monkeypatch.setattr(sm90, "dq_accumulator", nan_unless_zeroed)
    check_case(case, "cpu")
    assert _ran_atomic(atomic)
    assert asked and all(zeroed == fills for zeroed in asked)
