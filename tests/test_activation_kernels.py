"""The fused MLP-activation Triton kernels on small shapes (the CPU interpreter without CUDA):
forward and gradient of every activation against the PyTorch path in fp64 (the repo's pass rule,
attention_testing.check_close), odd widths, 3-D, row-strided and non-contiguous inputs, the
derivative at exactly 0, torch.compile tracing, the front end's checks and its backend choice.

Shapes: x [..., w] with w = 2n for gated activations; y and dy [..., n]; dx like x.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from attention_testing import check_close
from fusedlayers.kernels import _compat

import fusedlayers.layers.mlp as mlp
from fusedlayers.layers.mlp import ACTIVATIONS, LayerNormMLP, activation_reference, apply_activation

GATED = ("geglu", "reglu", "qgeglu", "sreglu", "swiglu")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def make_x(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Fresh random x spanning negatives and positives (std 2, so gelu's and sigmoid's curved
    range and the tails are all sampled), with no exact zeros: 0 is tested on its own."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 2).to(dtype)
    return torch.where(x == 0, torch.ones_like(x) * 0.5, x)


def make_dy(x: torch.Tensor, activation: str, seed: int) -> torch.Tensor:
    """A random incoming gradient shaped like y: [..., n], n = w / 2 for gated activations."""
    g = torch.Generator().manual_seed(seed + 1)
    n = x.shape[-1] // 2 if activation in GATED else x.shape[-1]
    return torch.randn(*x.shape[:-1], n, generator=g).to(x.dtype)


def results(fn, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """y and dx of `fn` on a fresh leaf with x's values and strides (detach keeps the view)."""
    leaf = x.detach().requires_grad_()
    y = fn(leaf)
    (dx,) = torch.autograd.grad(y, leaf, dy)
    return dict(y=y, dx=dx)


def check_activation(activation: str, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Kernel vs the PyTorch path in fp64 ("high") and in x's dtype ("low"): max error at most
    2x PyTorch's own, plus one eps at the result's magnitude, for y and for dx."""
    got = results(lambda t: apply_activation(t, activation, backend="kernel"), x, dy)
    high = results(lambda t: activation_reference(t, activation), x.double(), dy.double())
    low = results(lambda t: activation_reference(t, activation), x, dy)
    report = {}
    for name in ("y", "dx"):
        actual = got[name]
        assert actual.dtype == x.dtype, f"{name}: dtype {actual.dtype} != {x.dtype}"
        report[name] = check_close(name, actual, high[name], low[name], factor=2.0)
    return report


def problem(activation: str, lead: tuple[int, ...], n: int, dtype, seed: int):
    """(x [*lead, w], dy [*lead, n]) with w = 2n for gated activations."""
    width = 2 * n if activation in GATED else n
    x = make_x((*lead, width), dtype, seed)
    return x, make_dy(x, activation, seed)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("n", [33, 100])  # the interpreter's blocks are 32 wide: ragged last block
def test_matches_fp64_reference(device, activation, dtype, n):
    check_activation(activation, *problem(activation, (4, 3), n, dtype, seed=n))


@pytest.mark.parametrize("activation", ["swiglu", "sreglu", "gelu", "relu"])
@pytest.mark.parametrize(
    "lead, n",
    # 1 row; 2-D; many rows of a narrow output (ragged last row block); n = 1; 4-D.
    [((1,), 48), ((7,), 64), ((301,), 3), ((6,), 1), ((2, 3, 2), 20)],
)
def test_shapes(device, activation, lead, n):
    check_activation(activation, *problem(activation, lead, n, torch.float16, seed=2))


@pytest.mark.parametrize("activation", ["swiglu", "qgelu"])
@pytest.mark.parametrize("layout", ["sliced", "transposed"])
def test_strided_inputs(device, activation, layout):
    """sliced: x = x0[..., :w] of a wider x0, a row stride > w read in place (for a gated x the
    second half starts at n within each strided row); transposed: rows without one stride."""
    n, width = 40, 80 if activation in GATED else 40
    if layout == "sliced":
        x = make_x((5, 3, width + 7), torch.float32, seed=3)[..., :width]
    else:
        x = make_x((3, 5, width), torch.float32, seed=3).transpose(0, 1)
    assert not x.is_contiguous()
    dy = make_dy(x, activation, seed=3)
    assert dy.shape[-1] == n
    check_activation(activation, x, dy)


@pytest.mark.parametrize("activation", ["swiglu", "srelu"])
@pytest.mark.parametrize("layout", ["transposed", "strided_last_dim"])
def test_non_contiguous_dy(device, activation, layout):
    """The incoming gradient as a view: rows without one stride, or a strided last dim."""
    x = make_x((4, 6, 2 * 24 if activation in GATED else 24), torch.float16, seed=4)
    dy = make_dy(x, activation, seed=4)
    if layout == "transposed":
        dy = dy.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        dy = torch.stack([dy, -dy], dim=-1)[..., 0]  # stride(-1) == 2, same values
    assert not dy.is_contiguous() and torch.equal(dy, dy.contiguous())
    check_activation(activation, x, dy)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_derivative_at_zero(device, activation):
    """x with exact zeros (in both halves of a gated x): y and dx there equal what PyTorch's
    autograd gives, exactly (relu'(0) = srelu'(0) = 0; gelu, qgelu, silu: 1/2), and the pass rule
    holds everywhere."""
    x, dy = problem(activation, (6,), 40, torch.float32, seed=5)
    zero = torch.rand(x.shape, generator=torch.Generator().manual_seed(5)) < 0.3
    x = torch.where(zero, torch.zeros_like(x), x)
    got = results(lambda t: apply_activation(t, activation, backend="kernel"), x, dy)
    torch_fp32 = results(lambda t: activation_reference(t, activation), x, dy)
    # Exact where a term of y or dx is a product with act(0), act'(0) or a zero multiplier b:
    # gated y and dx[:, :n] wherever a or b is 0, dx[:, n:] = dy * act(a) wherever a is.
    n = dy.shape[-1]
    if activation in GATED:
        a_zero, b_zero = zero[..., :n], zero[..., n:]
        y_exact = a_zero | b_zero
        dx_exact = torch.cat([y_exact, a_zero], dim=-1)
    else:
        y_exact = dx_exact = zero
    assert torch.equal(got["dx"][dx_exact], torch_fp32["dx"][dx_exact])
    assert torch.equal(got["y"][y_exact], torch_fp32["y"][y_exact])
    check_activation(activation, x, dy)


def test_compile_traces_without_graph_break(device):
    """The custom ops' fake implementations let dynamo trace the whole call (aot_eager: the
    real kernels still run, so the compiled result must match eager bitwise)."""
    torch._dynamo.reset()

    def fn(x):
        return apply_activation(x * 2.0, "swiglu", backend="kernel") + 1.0

    x = make_x((3, 5, 2 * 24), torch.float32, seed=6).requires_grad_()
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    torch.compile(fn, fullgraph=True, backend=record)(x)
    assert "fusedlayers.activation_fwd.default" in seen  # compiled: the custom op
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager_y, compiled_y = fn(x), compiled(x)
    # Eager: the autograd.Function route around the dispatcher (kernels/_routes.py).
    assert "_EagerActivationBackward" in str(eager_y.grad_fn.next_functions)
    assert torch.equal(eager_y, compiled_y)
    dy = torch.randn_like(eager_y)
    (eager_dx,) = torch.autograd.grad(eager_y, x, dy)
    (compiled_dx,) = torch.autograd.grad(compiled_y, x, dy)
    assert torch.equal(eager_dx, compiled_dx)


@pytest.mark.parametrize(
    "x, activation, backend, message",
    [
        (torch.randn(2, 7), "swiglu", "auto", r"\('swiglu'\) is gated .* shape \(2, 7\)"),
        (torch.randn(()), "geglu", "reference", r"\('geglu'\) is gated .* shape \(\)"),
        (torch.randn(2, 8), "swish", "auto", r"activation \('swish'\) must be one of"),
        (torch.randn(2, 8), "gelu", "fast", r"backend \('fast'\) must be one of"),
        (
            torch.randn(2, 8, dtype=torch.float64),
            "gelu",
            "kernel",
            r"x dtype \(torch.float64\) is not one the activation kernel takes",
        ),
        (torch.ones(2, 8, dtype=torch.int32), "relu", "kernel", r"x dtype \(torch.int32\)"),
    ],
)
def test_bad_input_raises(x, activation, backend, message):
    with pytest.raises(ValueError, match=message):
        apply_activation(x, activation, backend=backend)


def test_auto_takes_the_kernel_for_cuda_tensors_of_its_dtypes(monkeypatch):
    """auto: CPU tensors take the reference; CUDA fp16/bf16/fp32 the kernel, fp64 the reference.
    reference always means the PyTorch path."""
    x = torch.randn(2, 8)
    assert mlp._use_kernel("auto", x) == (False, "x on cpu (no CUDA): reference path")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert mlp._use_kernel("auto", x.to(dtype)) == (True, "CUDA tensors")
        assert mlp._use_kernel("reference", x.to(dtype)) == (False, "use_reference=True")
    use, why = mlp._use_kernel("auto", x.double())
    assert not use and "x dtype (torch.float64)" in why and why.endswith("reference path")


def test_entry_runs_the_path_it_chose(monkeypatch):
    """apply_activation calls the kernel exactly when _use_kernel says so, and the forced CPU
    kernel needs TRITON_INTERPRET=1."""
    calls = []
    kernel = mlp.fused_activation
    monkeypatch.setattr(mlp, "fused_activation", lambda *a: calls.append(a[1]) or kernel(*a))
    x = make_x((3, 16), torch.float32, seed=7)
    for backend in ("auto", "reference", "kernel"):
        apply_activation(x, "geglu", backend=backend)
    assert calls == ["geglu"]
    monkeypatch.setattr(_compat, "INTERPRETER", False)  # kernels defined for a GPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors, got x on cpu"):
        apply_activation(x, "geglu", backend="kernel")


def test_layernorm_mlp_runs_the_kernel_unless_use_reference(monkeypatch):
    """LayerNormMLP asks for `auto`, or `reference` when switched; with `auto` sent to the kernel
    (as on CUDA) its output and gradients match its reference path."""
    seen = []
    choose = mlp._use_kernel

    def kernel_for_auto(backend, x):
        seen.append(backend)
        return choose("kernel" if backend == "auto" else backend, x)

    monkeypatch.setattr(mlp, "_use_kernel", kernel_for_auto)
    torch.manual_seed(8)
    layer = LayerNormMLP(16, 24, activation="swiglu", normalization="RMSNorm")
    x = make_x((3, 2, 16), torch.float32, seed=8).requires_grad_()
    out = []
    for use_reference in (False, True):
        layer.use_reference = use_reference
        y = layer(x)
        out.append((y, *torch.autograd.grad(y.square().sum(), [x, layer.fc1_weight])))
    assert seen == ["auto", "reference"]
    for kernel_result, reference_result in zip(*out):
        torch.testing.assert_close(kernel_result, reference_result, rtol=1e-5, atol=1e-5)


def test_debug_log_once_per_call_site(monkeypatch, caplog):
    monkeypatch.setenv("FUSEDLAYERS_DEBUG", "1")
    x = torch.randn(2, 8)
    with caplog.at_level(logging.INFO, logger="fusedlayers"):
        for _ in range(3):
            apply_activation(x, "reglu")
    records = [r.getMessage() for r in caplog.records if r.name == "fusedlayers"]
    assert len(records) == 1
    assert "(activation reglu): reference: x on cpu (no CUDA)" in records[0]


def test_benchmark_dry_run(tmp_path):
    """examples/perf/benchmark_activation.py's whole pipeline (inputs, check, timing stand-in,
    table) on tiny CPU shapes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "perf"))
    import benchmark_activation

    # fp16: its tolerance (3e-3) catches a kernel 1% off; bf16's would not.
    table = benchmark_activation.main(["--dry-run", "--dtype", "fp16", "--out", str(tmp_path)])
    assert (tmp_path / "activation.md").read_text() == table
    body = [line for line in table.splitlines() if line.startswith("| swiglu")]
    assert len(body) == 2 and "FAIL" not in table and "Error" not in table
