"""The LayerNorm / RMSNorm Triton kernels on small shapes (the CPU interpreter without CUDA):
forward and gradients against an fp64 reference (norm_testing's pass rule), odd hidden sizes,
3-D and non-contiguous inputs, mixed parameter dtypes, determinism, torch.compile tracing,
the front end's input checks and the modules' path choice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from fusedlayers.kernels import MAX_NORM_HIDDEN
from norm_testing import NormCase, check_norm_case, kernel_results, make_inputs

import fusedlayers.layers.normalization as normalization
from fusedlayers.layers.linear import LayerNormLinear
from fusedlayers.layers.mlp import LayerNormMLP
from fusedlayers.layers.normalization import LayerNorm, RMSNorm, apply_normalization


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("hidden", [33, 96, 257])
def test_matches_fp64_reference(device, dtype, rms, zero_centered_gamma, bias, hidden):
    case = NormCase(
        shape=(4, 3, hidden),
        dtype=dtype,
        rms=rms,
        zero_centered_gamma=zero_centered_gamma,
        bias=bias,
        seed=hidden,
    )
    check_norm_case(case, device)


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_strided_inputs(device, layout, rms):
    check_norm_case(NormCase(shape=(5, 3, 2, 40), layout=layout, rms=rms, seed=1), device)


@pytest.mark.parametrize(
    "shape",
    # 1 row; 2-D; many rows of a tiny hidden (several rows per program, several row blocks per
    # backward program, a ragged last block); hidden 1.
    [(1, 48), (7, 64), (301, 8), (6, 1)],
)
def test_shapes(device, shape):
    check_norm_case(NormCase(shape=shape, dtype=torch.float16, seed=2), device)


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float16, torch.float32)])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_mixed_parameter_dtype(device, x_dtype, w_dtype, zero_centered_gamma):
    case = NormCase(
        dtype=x_dtype, weight_dtype=w_dtype, zero_centered_gamma=zero_centered_gamma, seed=3
    )
    check_norm_case(case, device)


def test_backward_is_deterministic(device):
    case = NormCase(shape=(97, 3, 20), dtype=torch.float32, seed=4)
    inputs = make_inputs(case, device)
    first, second = kernel_results(inputs, case), kernel_results(inputs, case)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_front_end_kernel_matches_reference(device):
    """apply_normalization(backend="kernel") agrees with its own reference path."""
    case = NormCase(shape=(2, 3, 24), dtype=torch.float32, zero_centered_gamma=True, seed=5)
    inputs = make_inputs(case, device)
    args = (inputs["x"], inputs["weight"], inputs["bias"], case.eps, "LayerNorm", True)
    kernel = apply_normalization(*args, backend="kernel")
    reference = apply_normalization(*args, backend="reference")
    torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)


def test_compile_traces_without_graph_break(device):
    """The custom ops' fake implementations let dynamo trace the whole call (aot_eager: the
    real kernel still runs, so the compiled result must match eager bitwise)."""
    torch._dynamo.reset()
    norm = RMSNorm(40, zero_centered_gamma=True, device=device)
    with torch.no_grad():
        norm.weight.normal_()

    def fn(x):
        return apply_normalization(x, norm.weight, None, 1e-5, "RMSNorm", True, backend="kernel")

    x = torch.randn(3, 5, 40, device=device, requires_grad=True)
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    torch.compile(fn, fullgraph=True, backend=record)(x)
    assert "fusedlayers.norm_fwd.default" in seen  # compiled: the custom op
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager_y, compiled_y = fn(x), compiled(x)
    # Eager: the autograd.Function route around the dispatcher (kernels/_routes.py).
    assert type(eager_y.grad_fn).__name__ == "_EagerNormBackward"
    assert torch.equal(eager_y, compiled_y)
    eager_dx, eager_dw = torch.autograd.grad(eager_y.sum(), [x, norm.weight])
    compiled_dx, compiled_dw = torch.autograd.grad(compiled_y.sum(), [x, norm.weight])
    assert torch.equal(eager_dx, compiled_dx) and torch.equal(eager_dw, compiled_dw)


def _args(x_shape=(2, 8), w_shape=(8,), b_shape=(8,), dtype=torch.float32) -> tuple:
    x = torch.randn(x_shape).to(dtype)
    bias = None if b_shape is None else torch.randn(b_shape)
    return x, torch.randn(w_shape), bias, 1e-5


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (_args(w_shape=(7,)), {}, r"weight shape \(\(7,\)\) must be \(hidden,\) = \(8,\)"),
        (_args(b_shape=(8, 1)), {}, r"bias shape \(\(8, 1\)\) must be \(hidden,\) = \(8,\)"),
        (_args(dtype=torch.int32), {}, r"x dtype \(torch.int32\) must be a floating-point"),
        (_args(x_shape=()), {}, r"x must have a hidden \(last\) dimension"),
        (
            (torch.randn(2, 8), torch.randn(8, device="meta"), None, 1e-5),
            {},
            r"weight is on meta but x is on cpu",
        ),
        (_args(), {"backend": "fast"}, r"backend \('fast'\) must be one of"),
        (_args(), {"normalization": "BatchNorm"}, r"normalization \('BatchNorm'\) must be one"),
        (
            _args(dtype=torch.float64),
            {"backend": "kernel"},
            r"x dtype \(torch.float64\) is not one the norm kernel takes",
        ),
    ],
)
def test_bad_input_raises(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_normalization(*args, **kwargs)


def test_oversized_hidden_raises_for_kernel_and_falls_back_for_auto():
    n = MAX_NORM_HIDDEN + 1
    x, weight = torch.randn(1, n), torch.randn(n)
    with pytest.raises(ValueError, match=rf"hidden size \({n}\) exceeds"):
        apply_normalization(x, weight, None, 1e-5, "RMSNorm", backend="kernel")
    assert apply_normalization(x, weight, None, 1e-5, "RMSNorm").shape == (1, n)


def test_modules_choose_path_from_use_reference(monkeypatch):
    """Every norm-carrying module asks for `auto` normally and `reference` when switched."""
    seen = []
    choose = normalization._use_kernel

    def spy(backend, *args):
        seen.append(backend)
        return choose(backend, *args)

    monkeypatch.setattr(normalization, "_use_kernel", spy)
    modules = [
        LayerNorm(16),
        RMSNorm(16),
        LayerNormLinear(16, 8),
        LayerNormMLP(16, 32, normalization="RMSNorm"),
    ]
    x = torch.randn(2, 16)
    for module in modules:
        module(x)
        module.use_reference = True
        module(x)
    assert seen == ["auto", "reference"] * len(modules)


def test_auto_takes_the_kernel_on_cuda_from_the_measured_hidden_size(monkeypatch):
    """`auto` never takes the kernel for CPU tensors; for CUDA ones from KERNEL_MIN_HIDDEN (4096,
    the H100's break-even) and for calls of few rows (launch-bound), and never for many rows
    with None."""
    many = normalization.KERNEL_MAX_FEW_ROWS + 1
    w_small, w_large = torch.randn(16), torch.randn(4096)
    x_small, x_large = torch.randn(many, 16), torch.randn(many, 4096)
    x_few = torch.randn(normalization.KERNEL_MAX_FEW_ROWS, 16)
    assert normalization._use_kernel("auto", x_large, w_large, None)[0] is False
    assert normalization._use_kernel("auto", x_few, w_small, None)[0] is False
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    assert normalization.KERNEL_MIN_HIDDEN == 4096
    use, why = normalization._use_kernel("auto", x_small, w_small, None)
    assert not use and "hidden size (16) below" in why
    assert normalization._use_kernel("auto", x_large, w_large, None) == (True, "CUDA tensors")
    assert normalization._use_kernel("auto", x_few, w_small, None) == (True, "CUDA tensors")
    monkeypatch.setattr(normalization, "KERNEL_MIN_HIDDEN", None)
    assert normalization._use_kernel("auto", x_large, w_large, None)[0] is False
    assert normalization._use_kernel("auto", x_few, w_small, None)[0] is True


def test_benchmark_dry_run(tmp_path):
    """examples/perf/benchmark_norm.py's whole pipeline (inputs, checks, timing stand-in, table) on
    tiny CPU shapes; torch.compile's provider is left out to keep this fast."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "perf"))
    import benchmark_norm

    providers = "fusedlayers,torch-fp32,torch-native"
    table = benchmark_norm.main(["--dry-run", "--providers", providers, "--out", str(tmp_path)])
    assert (tmp_path / "norm.md").read_text() == table
    body = [line for line in table.splitlines() if line.startswith("| LayerNorm")]
    assert len(body) == 4 and "FAIL" not in table and "Error" not in table
