"""The LayerNorm / RMSNorm Triton kernels on the GPU at model sizes: forward and gradients against
an fp64 reference (norm_testing's pass rule), the modules under torch.compile(fullgraph=True),
and bitwise-reproducible backward passes."""

from __future__ import annotations

import pytest
import torch
from norm_testing import NormCase, check_norm_case, kernel_results, make_inputs

from fusedlayers.layers import normalization
from fusedlayers.layers.normalization import LayerNorm, RMSNorm

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROWS = 4096


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("hidden", [64, 1000, 1024, 4096, 8192])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_matches_fp64_reference(dtype, hidden, rms):
    case = NormCase(shape=(ROWS, hidden), dtype=dtype, rms=rms, bias=not rms, seed=hidden)
    check_norm_case(case, "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_zero_centered_gamma_and_3d(dtype, rms):
    case = NormCase(shape=(8, 256, 2048), dtype=dtype, rms=rms, zero_centered_gamma=True, seed=1)
    check_norm_case(case, "cuda")


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_strided_inputs(layout):
    case = NormCase(shape=(64, 32, 1536), dtype=torch.bfloat16, layout=layout, seed=2)
    check_norm_case(case, "cuda")


@pytest.mark.parametrize("rows, hidden", [(1024, 16384), (64, 65536)])
def test_wide_rows(rows, hidden):
    """Up to the kernels' MAX_HIDDEN: one row per program, 32 warps."""
    check_norm_case(NormCase(shape=(rows, hidden), dtype=torch.bfloat16, seed=3), "cuda")


def test_mixed_parameter_dtype():
    """bf16 activations with fp32 parameters (mixed-precision training); grads in fp32."""
    case = NormCase(shape=(ROWS, 2048), dtype=torch.bfloat16, weight_dtype=torch.float32, seed=4)
    check_norm_case(case, "cuda")


@pytest.mark.parametrize("norm_cls", [LayerNorm, RMSNorm])
def test_compiled_module_matches_eager(norm_cls, monkeypatch):
    """torch.compile(fullgraph=True) over a function using the module: the custom ops trace
    without a graph break and run the same kernels, so results match eager bitwise."""
    monkeypatch.setattr(normalization, "KERNEL_MIN_HIDDEN", 0)
    torch._dynamo.reset()
    norm = norm_cls(1024, zero_centered_gamma=True, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_(0, 0.5)

    def fn(x):
        return norm(x * 2.0) + 1.0

    x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for f in (fn, compiled):
        y = f(x)
        grads = torch.autograd.grad(y, [x, *norm.parameters()], dy)
        results.append((y, *grads))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_backward_is_deterministic(rms):
    case = NormCase(shape=(ROWS, 4096), dtype=torch.bfloat16, rms=rms, seed=5)
    inputs = make_inputs(case, "cuda")
    first, second = kernel_results(inputs, case), kernel_results(inputs, case)
    for name in first:
        assert torch.equal(first[name], second[name]), name
