"""The fused MLP-activation Triton kernels on the GPU at model sizes, bf16 and fp16: forward and
gradient of every activation against the PyTorch path in fp64 (the repo's pass rule,
attention_testing.check_close: at most 2x PyTorch's own error in the input dtype, plus one eps at
the result's magnitude), odd shapes under the CUDA tile geometry, int64 offsets past 2^31
elements, torch.compile(fullgraph=True), and LayerNormMLP on the kernels against
`use_reference=True`.

Shapes: x [..., w] with w = 2n for gated activations; y and dy [..., n]; dx like x.
"""

from __future__ import annotations

import pytest
import torch
from attention_testing import check_close

import fusedlayers.layers.mlp as mlp
from fusedlayers.layers.mlp import ACTIVATIONS, LayerNormMLP, activation_reference, apply_activation

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ROWS, N = 4096, 2048


def problem(activation: str, lead: tuple[int, ...], n: int, dtype, seed: int):
    """(x [*lead, w], dy [*lead, n]) on CUDA: x of std 2 (negatives, positives, the curved range
    and the tails), no exact zeros; w = 2n for gated activations."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = 2 * n if mlp.is_gated(activation) else n
    x = (torch.randn(*lead, width, generator=g, device="cuda") * 2).to(dtype)
    x = torch.where(x == 0, torch.full_like(x, 0.5), x)
    dy = torch.randn(*lead, n, generator=g, device="cuda").to(dtype)
    return x, dy


def results(fn, x: torch.Tensor, dy: torch.Tensor) -> dict:
    leaf = x.detach().requires_grad_()
    y = fn(leaf)
    (dx,) = torch.autograd.grad(y, leaf, dy)
    return dict(y=y, dx=dx)


def check_activation(activation: str, x: torch.Tensor, dy: torch.Tensor) -> None:
    """Kernel vs the PyTorch path in fp64 ("high") and in x's dtype ("low"), y and dx."""
    got = results(lambda t: apply_activation(t, activation, backend="kernel"), x, dy)
    high = results(lambda t: activation_reference(t, activation), x.double(), dy.double())
    low = results(lambda t: activation_reference(t, activation), x, dy)
    for name in ("y", "dx"):
        assert got[name].dtype == x.dtype
        check_close(name, got[name], high[name], low[name], factor=2.0)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_fp64_reference(activation, dtype):
    check_activation(activation, *problem(activation, (ROWS,), N, dtype, seed=0))


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu", "srelu"])
def test_odd_shapes(activation):
    """3-D, a row count that leaves a ragged last row block, n = 1024 + 513 (a ragged column
    block of the 1024-wide tiles), and a row-strided view (x0[..., :w] of a wider x0)."""
    x, dy = problem(activation, (3, 1365), 1537, torch.bfloat16, seed=1)
    check_activation(activation, x, dy)
    wide, _ = problem(activation, (3, 1365), 1537 + 8, torch.bfloat16, seed=2)
    check_activation(activation, wide[..., : x.shape[-1]], dy)


@pytest.mark.big_memory
def test_int64_offsets():
    """x [131200, 2 * 8192] bf16: row * stride passes 2^31 elements (4.3 GB). Checked on the last
    rows, where 32-bit offsets would wrap, against the PyTorch path on those rows."""
    rows, n = 131200, 8192
    x, _ = problem("swiglu", (rows,), n, torch.bfloat16, seed=3)
    x.requires_grad_()
    y = apply_activation(x, "swiglu", backend="kernel")
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    tail = slice(rows - 200, rows)
    tail_x, tail_dy = x[tail].detach(), dy[tail]
    expected = results(
        lambda t: activation_reference(t, "swiglu"), tail_x.double(), tail_dy.double()
    )
    low = results(lambda t: activation_reference(t, "swiglu"), tail_x, tail_dy)
    check_close("y", y[tail], expected["y"], low["y"], factor=2.0)
    check_close("dx", dx[tail], expected["dx"], low["dx"], factor=2.0)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_compiled_matches_eager(activation):
    """torch.compile(fullgraph=True) traces the custom ops and runs the same kernels: results
    match eager bitwise (x * 2 and + 1 are exact or single-rounded in both)."""
    torch._dynamo.reset()

    def fn(x):
        return apply_activation(x * 2.0, activation) + 1.0

    x, _ = problem(activation, (8, 512), 1024, torch.bfloat16, seed=4)
    x.requires_grad_()
    compiled = torch.compile(fn, fullgraph=True)
    eager_y, compiled_y = fn(x), compiled(x)
    dy = torch.randn_like(eager_y)
    (eager_dx,) = torch.autograd.grad(eager_y, x, dy)
    (compiled_dx,) = torch.autograd.grad(compiled_y, x, dy)
    torch.testing.assert_close(compiled_y, eager_y, rtol=0, atol=0)
    torch.testing.assert_close(compiled_dx, eager_dx, rtol=0, atol=0)


def _mlp_results(layer: LayerNormMLP, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Output and the gradients of x and of the FC1/FC2 weights."""
    x = x.detach().to(layer.fc1_weight.dtype).requires_grad_()
    out = layer(x)
    leaves = [x, layer.fc1_weight, layer.fc2_weight]
    grads = torch.autograd.grad(out, leaves, dy.to(out.dtype))
    return dict(out=out, dx=grads[0], dfc1=grads[1], dfc2=grads[2])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_layernorm_mlp_kernel_vs_reference(activation, dtype, monkeypatch):
    """LayerNormMLP on the kernels against the same layer with use_reference=True (both in
    `dtype`) and an fp32 copy on the reference path ("truth"): the kernel layer's error at most
    2x the reference layer's for the output, 3x for gradients (test_layers_gpu's factors: the
    gradients go through FC1/FC2's backward matmuls), plus one eps at the magnitude. Hidden 1024
    keeps the norm on its torch path in both, so only the activation differs."""
    calls = []
    kernel = mlp.fused_activation
    monkeypatch.setattr(mlp, "fused_activation", lambda *a: calls.append(a[1]) or kernel(*a))
    torch.manual_seed(5)
    truth = LayerNormMLP(1024, 2048, activation=activation, device="cuda", use_reference=True)
    layer = LayerNormMLP(1024, 2048, activation=activation, params_dtype=dtype, device="cuda")
    layer.load_state_dict(truth.state_dict())
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, 512, 1024, generator=g, device="cuda")
    dy = torch.randn(4, 512, 1024, generator=g, device="cuda")
    expected = _mlp_results(truth, x, dy)
    got = _mlp_results(layer, x, dy)
    assert calls == [activation], calls
    layer.use_reference = True
    low = _mlp_results(layer, x, dy)
    assert calls == [activation], "use_reference=True must not run the kernel"
    for name in got:
        factor = 2.0 if name == "out" else 3.0
        check_close(name, got[name], expected[name], low[name], factor=factor)


def test_layernorm_mlp_under_autocast(monkeypatch):
    """The GPT benchmark's setting: fp32 parameters, bf16 autocast. FC1 hands the kernel a bf16
    x; the layer matches its reference path within bf16 rounding."""
    calls = []
    kernel = mlp.fused_activation
    monkeypatch.setattr(mlp, "fused_activation", lambda x, a: calls.append(x.dtype) or kernel(x, a))
    torch.manual_seed(6)
    layer = LayerNormMLP(1024, 2048, activation="swiglu", device="cuda")
    x = torch.randn(4, 512, 1024, device="cuda")
    outs = []
    for use_reference in (False, True):
        layer.use_reference = use_reference
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs.append(layer(x))
    assert calls == [torch.bfloat16]
    torch.testing.assert_close(outs[0], outs[1], rtol=1.6e-2, atol=1.6e-2)
