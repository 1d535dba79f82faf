"""The residual add fused into the norm (`add_layer_norm`, `apply_add_normalization`, the MLP's
`residual=` and TransformerLayer's use of it), on small shapes (the CPU interpreter without
CUDA): the kernel equals the separate add and norm bit for bit, its gradients match an fp64
reference, and the layers compute what they computed before."""

from __future__ import annotations

import pytest
import torch
from attention_testing import check_close
from fusedlayers.kernels import add_layer_norm, layer_norm
from norm_testing import NormCase, make_inputs, torch_norm

from fusedlayers.layers.mlp import LayerNormMLP
from fusedlayers.layers.normalization import apply_add_normalization
from fusedlayers.layers.transformer_layer import TransformerLayer


def _residual_like(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(x.shape, generator=g) * 3 - 1).to(x.device, x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
def test_fused_add_equals_add_then_norm(device, dtype, rms, layout):
    """h is x + residual rounded as torch rounds it, and y is the norm kernel's result on that
    h: both bitwise."""
    case = NormCase(shape=(4, 5, 48), dtype=dtype, rms=rms, layout=layout, seed=11)
    inputs = make_inputs(case, device)
    x, weight, bias = inputs["x"], inputs["weight"], inputs["bias"]
    residual = _residual_like(x, 12)
    y, h = add_layer_norm(x, residual, weight, bias, case.eps, rms=rms, zero_centered_gamma=False)
    expected_h = x + residual
    assert torch.equal(h, expected_h)
    assert torch.equal(y, layer_norm(expected_h, weight, bias, case.eps, rms=rms,
                                     zero_centered_gamma=False))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc"])
def test_gradients_match_fp64_reference(device, dtype, zero_centered_gamma):
    """x and residual get the norm's input gradient plus h's own (h feeds the next residual);
    weight and bias as the plain norm's. Against fp64, with norm_testing's pass rule."""
    case = NormCase(shape=(6, 40), dtype=dtype, zero_centered_gamma=zero_centered_gamma, seed=3)
    inputs = make_inputs(case, device)
    residual = _residual_like(inputs["x"], 4)
    dh = torch.randn(case.shape, generator=torch.Generator().manual_seed(5)).to(device, dtype)

    def run(compute, fused):
        leaves = [
            t.detach().to(compute).requires_grad_()
            for t in (inputs["x"], residual, inputs["weight"], inputs["bias"])
        ]
        x, r, w, b = leaves
        if fused:
            y, h = add_layer_norm(x, r, w, b, case.eps, rms=False,
                                  zero_centered_gamma=zero_centered_gamma)  # fmt: skip
        else:
            h = x + r
            y = torch_norm(h, w, b, case, compute)
        grads = torch.autograd.grad((y, h), leaves, (inputs["dy"].to(compute), dh.to(compute)))
        return dict(y=y, h=h, **dict(zip(("dx", "dresidual", "dweight", "dbias"), grads)))

    got = run(dtype, fused=True)
    high = run(torch.float64, fused=False)
    low = run(dtype, fused=False)
    assert torch.equal(got["dx"], got["dresidual"])
    for name, actual in got.items():
        factor = 2.0 if name in ("y", "h") else 3.0
        check_close(name, actual, high[name], low[name].to(actual.dtype), factor=factor)


def test_front_end_paths_agree_and_check_the_residual(device):
    """`apply_add_normalization`: the kernel path equals its reference path (the add, then the
    fp32 torch norm) to rounding, and a residual of another shape or dtype is refused."""
    case = NormCase(shape=(3, 24), dtype=torch.float32, seed=8)
    inputs = make_inputs(case, device)
    x, residual = inputs["x"], _residual_like(inputs["x"], 9)
    args = (inputs["weight"], inputs["bias"], case.eps, "LayerNorm", False)
    y_k, h_k = apply_add_normalization(x, residual, *args, backend="kernel")
    y_r, h_r = apply_add_normalization(x, residual, *args, backend="reference")
    assert torch.equal(h_k, h_r)
    torch.testing.assert_close(y_k, y_r, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"residual \(\(3, 25\)"):
        apply_add_normalization(x, torch.zeros(3, 25, device=device), *args)
    with pytest.raises(ValueError, match="torch.float16"):
        apply_add_normalization(x, residual.half(), *args)


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_mlp_with_a_residual_runs_on_the_sum_and_returns_it(device, backend, monkeypatch):
    """LayerNormMLP(inp, residual=r) is LayerNormMLP(r + inp), with r + inp returned last."""
    if backend == "kernel":  # CPU tensors take the reference unless the kernel is asked for
        import fusedlayers.layers.normalization as normalization

        monkeypatch.setattr(normalization, "KERNEL_MIN_HIDDEN", 1)
        monkeypatch.setattr(normalization, "_use_kernel", lambda *a: (True, "test"))
    torch.manual_seed(0)
    mlp = LayerNormMLP(32, 64, device=device)
    with torch.no_grad():
        mlp.layer_norm_weight.normal_()
        mlp.layer_norm_bias.normal_()
    inp = torch.randn(2, 3, 32, device=device)
    residual = torch.randn(2, 3, 32, device=device)
    out, total = mlp(inp, residual=residual)
    assert torch.equal(total, residual + inp)
    torch.testing.assert_close(out, mlp(residual + inp), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dropout, training, fused", [(0.0, True, True), (0.1, False, True),
                                                      (0.1, True, False)])  # fmt: skip
def test_transformer_layer_fuses_only_without_dropout(dropout, training, fused, monkeypatch):
    """TransformerLayer sends its pre-MLP residual add into the MLP's norm when no dropout
    applies, and the layer's output is what the separate add gives."""
    torch.manual_seed(1)
    layer = TransformerLayer(32, 64, 4, hidden_dropout=dropout, attention_dropout=0.0)
    layer.train(training)
    x = torch.randn(5, 2, 32)
    calls = []
    forward = LayerNormMLP.forward

    def spy(self, inp, residual=None):
        calls.append(residual is not None)
        return forward(self, inp, residual)

    monkeypatch.setattr(LayerNormMLP, "forward", spy)
    torch.manual_seed(2)
    out = layer(x)
    assert calls == [fused]
    if fused:
        monkeypatch.setattr(TransformerLayer, "_fuse_residual", lambda *a: False)
        assert torch.equal(out, layer(x))


def test_compile_traces_the_fused_op(device):
    """The op's fake implementation lets dynamo trace it whole (aot_eager runs the real kernel,
    so the compiled outputs and gradients equal eager's bitwise)."""
    torch._dynamo.reset()
    weight = torch.randn(40, device=device, requires_grad=True)

    def fn(x, r):
        return add_layer_norm(x, r, weight, None, 1e-5, rms=True, zero_centered_gamma=False)

    x = torch.randn(3, 40, device=device, requires_grad=True)
    r = torch.randn(3, 40, device=device, requires_grad=True)
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    torch.compile(fn, fullgraph=True, backend=record)(x, r)
    assert "fusedlayers.add_norm_fwd.default" in seen
    eager, compiled = fn(x, r), torch.compile(fn, fullgraph=True, backend="aot_eager")(x, r)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    grads = [
        torch.autograd.grad(sum(t.sum() for t in out), [x, r, weight]) for out in (eager, compiled)
    ]
    for a, b in zip(*grads):
        assert torch.equal(a, b)
