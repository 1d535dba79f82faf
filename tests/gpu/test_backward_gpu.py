"""The flash-attention backward on CUDA (fp16/bf16) against fp64 autograd.

Each case runs `flash_attention_backward` on `out`/`lse` from the reference in the input dtype,
so a failure points at the backward alone. Pass rule: every gradient's max error against fp64
autograd through `attention_reference` is at most 3x the error of PyTorch computing it from
input-dtype tensors, plus one unit of the dtype at the gradient's magnitude.

The launch-shape sweep that picks the table entries is `examples/perf/tune_attention.py --bwd`.

Layouts: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d(_v)]; varlen q [t_q, h, d]; lse dense
[b, h, s_q] / varlen [h, t_q].
"""

from __future__ import annotations

import pytest
import torch
from fusedlayers.kernels import _flash_bwd, dropout_keep_mask
from fusedlayers.kernels._flash_bwd import flash_attention_backward

from fusedlayers.attention.reference import attention_reference

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
# The forward launcher's sequence and bias arguments for a dense batch with none of them.
NO_SEQUENCES = dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q", "seq_offsets_k",
                              "max_seqlen_q", "max_seqlen_k", "seqlens_q", "seqlens_k", "bias",
                              "alibi_slopes"))  # fmt: skip

# name: (b, s_q, s_k, h, h_kv, d, d_v, window, bottom_right, extras). Lengths are not multiples
# of the block sizes, so every case has ragged edge blocks.
CASES = {
    "d40-mha-full": (2, 300, 300, 4, 4, 40, None, (-1, -1), True, {}),
    "d59-gqa-causal-br": (2, 200, 333, 4, 2, 59, None, (-1, 0), True, {}),
    "d80-mqa-causal-tl": (2, 333, 200, 4, 1, 80, None, (-1, 0), False, {}),
    "d96-window-br": (1, 400, 450, 4, 2, 96, None, (64, 32), True, {}),
    "d128-dv64-causal": (1, 512, 512, 4, 2, 128, 64, (-1, 0), True, {}),
    "d160-full": (1, 256, 300, 2, 2, 160, None, (-1, -1), True, {}),
    "d192-gqa-causal": (1, 300, 300, 4, 2, 192, None, (-1, 0), True, {}),
    "d256-full": (1, 256, 200, 2, 1, 256, None, (-1, -1), True, {}),
    "d8-mqa": (2, 100, 130, 2, 1, 8, None, (-1, -1), True, {}),
    "d64-bias-alibi-softcap": (2, 200, 260, 2, 2, 64, None, (-1, 0), True,
                               dict(bias=True, alibi=True, softcap=5.0)),
    "d64-dropout-window": (2, 300, 300, 4, 2, 64, None, (100, 0), True, dict(dropout_p=0.2)),
    "d111-varlen-gaps": (3, 300, 280, 4, 2, 111, None, (-1, 0), True, dict(varlen=True)),
    "d128-seqlens": (2, 300, 350, 2, 2, 128, None, (-1, 0), False, dict(seqlens=True)),
    # Past SHORT_SEQLEN: the main launch table (the causal cases above read the short one).
    "d64-gqa-causal-long": (1, 1300, 1500, 4, 2, 64, None, (-1, 0), True, {}),
    "d128-full-long": (1, 1500, 1300, 2, 2, 128, None, (-1, -1), True, {}),
}  # fmt: skip


def _make(case, dtype, seed=0):
    """(tensors, reference kwargs, kernel kwargs) for one case, fresh random inputs on CUDA."""
    b, s_q, s_k, h, h_kv, d, d_v, window, bottom_right, extras = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    d_v = d_v or d

    def randn(*shape, dt=dtype):
        return torch.randn(shape, generator=g, device="cuda").to(dt)

    ref = dict(softmax_scale=d**-0.5, window_size=window, bottom_right=bottom_right)
    kern = dict(softmax_scale=d**-0.5, window_left=window[0], window_right=window[1],
                bottom_right=bottom_right)  # fmt: skip
    lead_q, lead_k = (b, s_q), (b, s_k)
    if extras.get("varlen"):
        lens_q, lens_k = [s_q, s_q // 3, 1][:b], [s_k, 7, s_k // 2][:b]
        starts_q = [sum(lens_q[:z]) + 5 * (z + 1) for z in range(b + 1)]
        starts_k = [sum(lens_k[:z]) + 3 * (z + 1) for z in range(b + 1)]
        cu_q, cu_k, off_q, off_k = (
            torch.tensor(values, dtype=torch.int32, device="cuda")
            for values in ([sum(lens_q[:z]) for z in range(b + 1)],
                           [sum(lens_k[:z]) for z in range(b + 1)], starts_q, starts_k)
        )  # fmt: skip
        ref.update(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, cu_seqlens_q_padded=off_q,
                   cu_seqlens_kv_padded=off_k)  # fmt: skip
        kern.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seq_offsets_q=off_q,
                    seq_offsets_k=off_k, max_seqlen_q=s_q, max_seqlen_k=s_k)  # fmt: skip
        lead_q, lead_k = (starts_q[-1],), (starts_k[-1],)
    if extras.get("seqlens"):
        lens_q = torch.tensor([s_q, s_q // 2 + 1], dtype=torch.int32, device="cuda")
        lens_k = torch.tensor([s_k // 3, s_k], dtype=torch.int32, device="cuda")
        ref.update(seqlens_q=lens_q, seqlens_kv=lens_k)
        kern.update(seqlens_q=lens_q, seqlens_k=lens_k)
    tensors = dict(q=randn(*lead_q, h, d), k=randn(*lead_k, h_kv, d),
                   v=randn(*lead_k, h_kv, d_v), dout=randn(*lead_q, h, d_v))  # fmt: skip
    if extras.get("bias"):
        tensors["bias"] = randn(b, h, s_q, s_k)
    if extras.get("alibi"):
        slopes = torch.rand(b, h, generator=g, device="cuda") * 0.3
        ref["alibi_slopes"] = kern["alibi_slopes"] = slopes
    for name in ("softcap", "dropout_p"):
        if name in extras:
            ref[name] = kern[name] = extras[name]
    if extras.get("dropout_p"):
        seed, offset = 1234567, 89
        ref["dropout_mask"] = dropout_keep_mask((seed, offset), b, h, s_q, s_k,
                                                extras["dropout_p"], "cuda")  # fmt: skip
        kern.update(seed=seed, offset=offset)
    return tensors, ref, kern


def _reference(tensors, dtype, ref):
    """(out, lse, {dq, dk, dv[, dbias]}) from attention_reference on copies in `dtype`."""
    names = [n for n in ("q", "k", "v", "bias") if n in tensors]
    leaves = {n: tensors[n].detach().to(dtype).requires_grad_() for n in names}
    out, lse = attention_reference(
        leaves["q"], leaves["k"], leaves["v"], bias=leaves.get("bias"), return_lse=True, **ref
    )
    grads = torch.autograd.grad(out, list(leaves.values()), tensors["dout"].to(dtype))
    return out.detach(), lse, {f"d{n}": gr for n, gr in zip(names, grads)}


def _backward(tensors, out, lse, kern):
    bias = tensors.get("bias")
    dq, dk, dv, dbias = flash_attention_backward(
        tensors["dout"], tensors["q"], tensors["k"], tensors["v"], out, lse,
        bias=bias, bias_requires_grad=bias is not None, **kern,
    )  # fmt: skip
    got = dict(dq=dq, dk=dk, dv=dv)
    if bias is not None:
        got["dbias"] = dbias
    return got


def _errors(got, high, low) -> dict:
    """{name: (kernel error, PyTorch low-precision error, bound)}; raises on NaN or shape."""
    report = {}
    for name, value in got.items():
        assert value.shape == high[name].shape, name
        assert torch.isfinite(value).all(), f"{name}: non-finite gradient"
        error = (value.double() - high[name]).abs().max().item()
        pytorch_error = (low[name].double() - high[name]).abs().max().item()
        atol = torch.finfo(value.dtype).eps * max(high[name].abs().max().item(), 1e-3)
        report[name] = (error, pytorch_error, 3.0 * pytorch_error + atol)
    return report


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "two-pass"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_backward_matches_reference(case, dtype, deterministic, monkeypatch):
    """Both backward schemes (a bias gradient always takes the two-pass one)."""
    monkeypatch.setattr(_flash_bwd, "ATOMIC_DQ_DEVICES", "cuda")  # off by default until measured
    tensors, ref, kern = _make(case, dtype)
    _, _, high = _reference(tensors, torch.float64, ref)
    out, lse, low = _reference(tensors, dtype, ref)
    report = _errors(_backward(tensors, out, lse, dict(kern, deterministic=deterministic)), high,
                     low)  # fmt: skip
    failed = {n: r for n, r in report.items() if r[0] > r[2]}
    assert not failed, "kernel error > 3 x PyTorch error + atol: " + ", ".join(
        f"{n}: {e:.3e} vs {p:.3e} (bound {b:.3e})" for n, (e, p, b) in failed.items()
    )


@pytest.mark.parametrize("lengths", [(900, 1000), (1000, 1100)], ids=["short", "long"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_is_bitwise_deterministic(d, causal, lengths, monkeypatch):
    """deterministic=True (no atomics): two runs agree bit for bit (GQA, long enough to tile).
    The atomic-dQ scheme: dk/dv bitwise equal run to run, dq close.

    Also guards the launch tables, short (causal up to SHORT_SEQLEN) and main, against Triton
    miscompiles that race (see BWD_CONFIGS).
    """
    s_q, s_k = lengths
    assert (max(lengths) <= _flash_bwd.SHORT_SEQLEN) == (s_k == 1000)
    case = (2, s_q, s_k, 8, 2, d, None, (-1, 0 if causal else -1), True, {})
    tensors, ref, kern = _make(case, BF16, seed=3)
    out, lse, _ = _reference(tensors, BF16, ref)
    first = _backward(tensors, out, lse, dict(kern, deterministic=True))
    second = _backward(tensors, out, lse, dict(kern, deterministic=True))
    for name in first:
        assert torch.equal(first[name], second[name]), name
    monkeypatch.setattr(_flash_bwd, "ATOMIC_DQ_DEVICES", "cuda")  # off by default until measured
    atomic = [_backward(tensors, out, lse, dict(kern, deterministic=False)) for _ in range(2)]
    for name in ("dk", "dv"):
        assert torch.equal(atomic[0][name], atomic[1][name]), name
    for name in first:
        assert _relative_error(atomic[0][name], first[name]) < 1e-2, name


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.big_memory
def test_64k_token_sequence():
    """b=1, h=8, s=65536, d=128 bf16 causal: int64 indexing; compared with SDPA's flash backend.

    Both sides are bf16 kernels, so the check is on the relative error norm, which an indexing
    overflow (wrong rows read or written) would push to order 1.
    """
    from fusedlayers.kernels._flash_fwd import flash_attention_forward
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, dout = (
        torch.randn(1, 65536, 8, 128, generator=g, device="cuda", dtype=BF16) for _ in range(4)
    )
    kern = dict(softmax_scale=128**-0.5, window_left=-1, window_right=0, bottom_right=True)
    out, lse = flash_attention_forward(
        q, k, v, **NO_SEQUENCES, **kern, softcap=0.0, dropout_p=0.0, seed=0, offset=0
    )
    got = _backward(dict(q=q, k=k, v=v, dout=dout), out, lse, kern)
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref_out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.transpose(1, 2))
    assert _relative_error(out, ref_out.transpose(1, 2)) < 1e-2
    for name, ref_grad in zip(("dq", "dk", "dv"), ref_grads):
        assert torch.isfinite(got[name]).all(), name
        assert _relative_error(got[name], ref_grad.transpose(1, 2)) < 2e-2, name
