"""FP8 GEMMs on the GPU (`torch._scaled_mm`) against the emulation on the same casts and scales.

Each module has a twin with the same weights whose GEMM modules take the reference path
(`use_reference=True`): both cast with the same code, so their FP8 operands are identical and the
outputs differ only by the GEMM's accumulation (cuBLASLt's fast accumulation in the forward) and
the final rounding to bf16. They must agree within a few bf16 units of the output's scale; a
wrong layout, a swapped scale or an unscaled operand is off by orders of magnitude. Needs an
sm_89+ GPU (skipped below that: the modules would raise, which test_fp8_layers.py covers).
"""

from __future__ import annotations

import copy

import pytest
import torch

import fusedlayers as te
from fusedlayers import ArgumentError, recipe
from fusedlayers.fp8._torch_compat import scaled_mm
from fusedlayers.fp8.scaling import dequantize, quantize
from fusedlayers.layers.gemm_module import GemmModule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not te.is_fp8_available(), reason="FP8 GEMMs need an sm_89+ GPU (Ada, Hopper)"
    ),
]

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
}
TOL = 2**-6  # four bf16 units, relative to the output's largest value


def _close(fast, emulated, what, tol=TOL):
    fast, emulated = fast.float(), emulated.float()
    scale = emulated.abs().max().item()
    err = (fast - emulated).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} vs {tol * scale:.3g} allowed"


def _emulating_twin(module: torch.nn.Module) -> torch.nn.Module:
    twin = copy.deepcopy(module)
    for m in twin.modules():
        if isinstance(m, GemmModule):
            m.use_reference = True  # its GEMMs only: attention and norms keep their path
    return twin


def _step(module, x, grad, r, steps=2):
    """`steps` FP8 steps on the same input (the last on delayed scales from the first); the last
    output and the gradients of the input and every parameter."""
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        inp = x.detach().clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=r):
            out = module(inp)
        out.backward(grad)
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    return out, inp.grad, grads


def _compare(module, x, r_name, tol=TOL):
    torch.manual_seed(0)
    twin = _emulating_twin(module)
    grad = torch.randn_like(module(x))
    fast = _step(module, x, grad, RECIPES[r_name]())
    emulated = _step(twin, x, grad, RECIPES[r_name]())
    _close(fast[0], emulated[0], "output", tol)
    _close(fast[1], emulated[1], "input gradient", tol)
    for name, g in fast[2].items():
        _close(g, emulated[2][name], f"{name} gradient", tol)
    return module, twin


def test_scaled_mm_matches_dequantized_product():
    """The compatibility wrapper's layouts and scales: `_scaled_mm` of two cast operands equals
    their dequantized product (same fp32 accumulation, no fast accumulation)."""
    torch.manual_seed(0)
    a = torch.randn(64, 128, device="cuda")
    b = torch.randn(96, 128, device="cuda")
    # Power-of-2 scales: the dequantized operands are exact even if fp32 matmuls use TF32.
    qa = quantize(a, torch.float8_e4m3fn, torch.tensor(32.0, device="cuda"))
    qb = quantize(b, torch.float8_e5m2, torch.tensor(512.0, device="cuda"))
    got = scaled_mm(qa.data, qb.data.t(), qa.scale_inv, qb.scale_inv, torch.float32)
    want = dequantize(qa) @ dequantize(qb).t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("r_name", list(RECIPES))
def test_linear(r_name):
    torch.manual_seed(1)
    layer = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    fast, twin = _compare(layer, x, r_name)
    if r_name == "delayed":  # same inputs and weights: the same forward scales
        assert torch.equal(fast.fp8_meta.scale_fwd, twin.fp8_meta.scale_fwd)
        assert torch.equal(fast.fp8_meta.scale_bwd, twin.fp8_meta.scale_bwd)


@pytest.mark.parametrize("r_name", list(RECIPES))
def test_layernorm_linear(r_name):
    torch.manual_seed(2)
    layer = te.LayerNormLinear(512, 768, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 2, 512, device="cuda", dtype=torch.bfloat16)
    _compare(layer, x, r_name)


@pytest.mark.parametrize("r_name", list(RECIPES))
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp(r_name, activation):
    torch.manual_seed(3)
    mlp = te.LayerNormMLP(
        512, 1024, activation=activation, params_dtype=torch.bfloat16, device="cuda"
    )
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    _compare(mlp, x, r_name)


@pytest.mark.parametrize("r_name", list(RECIPES))
def test_transformer_layer(r_name):
    torch.manual_seed(4)
    layer = te.TransformerLayer(
        512, 2048, 8, num_gqa_groups=4, hidden_dropout=0.0, attention_dropout=0.0,
        fuse_qkv_params=True, normalization="RMSNorm", activation="swiglu",
        params_dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    x = torch.randn(256, 2, 512, device="cuda", dtype=torch.bfloat16)
    # Norms and activations may take kernels on one side and torch on the other: bf16 units
    # of difference before the GEMMs, so a layer gets the looser layer tolerance.
    _compare(layer, x, r_name, tol=5e-2)


def test_fp32_master_weights_under_torch_autocast():
    """Training's usual setup: fp32 parameters, bf16 autocast; FP8 GEMMs take the autocast
    dtype for their output and give fp32 weight gradients."""
    torch.manual_seed(5)
    layer = te.LayerNormMLP(256, 1024, device="cuda")
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16), te.fp8_autocast():
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    assert layer.fc1_weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_fp8_model_init_on_the_gpu():
    torch.manual_seed(6)
    reference = te.LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device="cuda")
    torch.manual_seed(6)
    with te.fp8_model_init():
        mlp = te.LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        out = mlp(x)
    out.sum().backward()
    _close(out, reference(x), "output", tol=0.1)
    moved = mlp.cpu().cuda()  # bytes travel unchanged
    assert moved.fc1_weight.dtype == torch.float8_e4m3fn


def test_bad_shapes_raise_before_cublas():
    layer = te.Linear(100, 64, params_dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ArgumentError, match="K=100"), te.fp8_autocast():
        layer(torch.randn(32, 100, device="cuda", dtype=torch.bfloat16))


def test_te_training_snippet_on_the_gpu():
    hidden, ffn, heads = 1024, 4096, 16
    model = te.TransformerLayer(
        hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fp8_recipe = recipe.DelayedScaling(
        fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"
    )
    x = torch.randn(512, 4, hidden, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out = model(x)
        out.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(out).all()
