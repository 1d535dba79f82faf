"""Shared harness for the LayerNorm / RMSNorm kernel tests (CPU interpreter and GPU suites).

Pass rule (attention_testing.check_close, flash-attn's): the kernel's max error against an fp64
reference is at most 2x (forward) or 3x (gradients) the max error of the same torch computation
done in the input dtype, plus one eps of the result's dtype at the reference's magnitude.

Shapes: x [..., n], weight/bias [n], dy like x.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from attention_testing import check_close
from fusedlayers.kernels import layer_norm


@dataclasses.dataclass(frozen=True)
class NormCase:
    """One normalization problem. `layout`: "contiguous", "transposed" (x is x0.transpose(0, 1)
    of a contiguous x0, so rows do not share one stride and the launcher copies) or "sliced"
    (x is x0[..., :n] of a wider x0: a row stride larger than n, read in place)."""

    shape: tuple[int, ...] = (3, 5, 33)
    dtype: torch.dtype = torch.float32
    weight_dtype: torch.dtype | None = None  # None = dtype
    rms: bool = False
    zero_centered_gamma: bool = False
    bias: bool = True
    layout: str = "contiguous"
    eps: float = 1e-5
    seed: int = 0


def make_inputs(case: NormCase, device) -> dict:
    """Fresh random x (offset from 0, so LayerNorm's centering matters), weight, bias, dy."""
    g = torch.Generator().manual_seed(case.seed)
    n = case.shape[-1]
    lead = case.shape[:-1]
    if case.layout == "transposed":
        x0 = torch.randn(lead[1], lead[0], *lead[2:], n, generator=g) * 2 + 0.5
        x = x0.to(device, case.dtype).transpose(0, 1)
    elif case.layout == "sliced":
        x0 = torch.randn(*lead, n + 7, generator=g) * 2 + 0.5
        x = x0.to(device, case.dtype)[..., :n]
    else:
        x = (torch.randn(*case.shape, generator=g) * 2 + 0.5).to(device, case.dtype)
    w_dtype = case.weight_dtype or case.dtype
    # Zero-centered weights are small (gamma - 1); plain ones are spread around 1. Never constant.
    w_center = 0.0 if case.zero_centered_gamma else 1.0
    weight = (torch.randn(n, generator=g) * 0.5 + w_center).to(device, w_dtype)
    bias = (torch.randn(n, generator=g) * 0.5).to(device, w_dtype) if case.bias else None
    dy = torch.randn(*case.shape, generator=g).to(device, case.dtype)
    return dict(x=x, weight=weight, bias=bias, dy=dy)


def torch_norm(x, weight, bias, case: NormCase, compute: torch.dtype) -> torch.Tensor:
    """The torch computation entirely in `compute` (fp64 = the reference, x's dtype = "low")."""
    x, weight = x.to(compute), weight.to(compute)
    gamma = weight + 1 if case.zero_centered_gamma else weight
    n = (x.shape[-1],)
    if case.rms:
        y = F.rms_norm(x, n, gamma, case.eps)
        return y if bias is None else y + bias.to(compute)
    return F.layer_norm(x, n, gamma, None if bias is None else bias.to(compute), case.eps)


def _results(fn, inputs: dict, leaf_dtypes: dict) -> dict:
    """Forward output and grads of x, weight, bias from `fn`, on fresh leaves cast as asked."""
    leaves = {
        name: t.detach().to(leaf_dtypes[name]).requires_grad_()
        for name, t in inputs.items()
        if name != "dy" and t is not None
    }
    y = fn(leaves["x"], leaves["weight"], leaves.get("bias"))
    grads = torch.autograd.grad(y, list(leaves.values()), inputs["dy"].to(y.dtype))
    return dict(y=y, **{f"d{name}": grad for name, grad in zip(leaves, grads)})


def kernel_results(inputs: dict, case: NormCase) -> dict:
    dtypes = {name: t.dtype for name, t in inputs.items() if t is not None}
    fn = lambda x, w, b: layer_norm(  # noqa: E731
        x, w, b, case.eps, rms=case.rms, zero_centered_gamma=case.zero_centered_gamma
    )
    return _results(fn, inputs, dtypes)


def check_norm_case(case: NormCase, device) -> dict:
    """Run kernel, fp64 reference and input-dtype torch; assert the pass rule on y and grads."""
    inputs = make_inputs(case, device)
    got = kernel_results(inputs, case)
    as_dtype = {name: torch.float64 for name in inputs}
    high = _results(lambda x, w, b: torch_norm(x, w, b, case, torch.float64), inputs, as_dtype)
    # "Low": torch with every tensor in x's dtype (weights too: F.layer_norm wants one dtype).
    as_dtype = {name: case.dtype for name in inputs}
    low = _results(lambda x, w, b: torch_norm(x, w, b, case, case.dtype), inputs, as_dtype)
    assert got["y"].dtype == case.dtype and got["y"].shape == inputs["x"].shape
    report = {}
    for name, actual in got.items():
        expected_dtype = inputs[name[1:]].dtype if name != "y" else case.dtype
        assert actual.dtype == expected_dtype, f"{name}: dtype {actual.dtype} != {expected_dtype}"
        factor = 2.0 if name == "y" else 3.0
        report[name] = check_close(
            name, actual, high[name], low[name].to(actual.dtype), factor=factor
        )
    return report
