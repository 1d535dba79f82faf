"""FP8 GEMMs on the GPU (`torch._scaled_mm`) against the emulation on the same casts and scales.

Each module runs three ways on the same weights, input and output gradient: *fast* (the GEMMs on
`torch._scaled_mm`), *emulated* (a twin whose GEMM modules take the reference path,
`use_reference=True`: dequantize and multiply in fp32) and *exact* (an fp32 copy on the
reference path, outside `fp8_autocast`). Fast and emulated are not compared to each other
directly: where a tensor is cast to FP8 again between GEMMs (fc2's input after the activation,
the backward's E5M2 gradients), a one-unit bf16 difference upstream flips an FP8 rounding
(12.5-25% of that element) and spreads, so no fixed tolerance between them is both tight and
reliable. The pass rule ("2x rule") is that the fast path's error against exact is at most twice
the emulation's, plus one bf16 unit of exact's scale: the FP8 rounding error is what both have,
and a wrong layout, a swapped scale or an unscaled operand is off by orders of magnitude. Needs an
sm_89+ GPU (skipped below that: the modules would raise, which test_fp8_layers.py covers).
"""

from __future__ import annotations

import contextlib
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
# The 2x rule's absolute term, relative to exact's largest value: one bf16 unit (8 significant
# bits), the rounding of the fast and emulated results themselves, and room for tensors whose
# FP8 error is near zero (a bias gradient summed from the unquantized dy).
EPS = 2**-8


def _close(fast, emulated, what, tol):
    fast, emulated = fast.float(), emulated.float()
    scale = emulated.abs().max().item()
    err = (fast - emulated).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} vs {tol * scale:.3g} allowed"


def _within_2x(fast, emulated, exact, what):
    """The 2x rule on tensors of one shape: max|fast - exact| <= 2 max|emulated - exact| + eps."""
    assert fast.shape == emulated.shape == exact.shape, what
    fast, emulated, exact = fast.double(), emulated.double(), exact.double()
    err_fast = (fast - exact).abs().max().item()
    err_emulated = (emulated - exact).abs().max().item()
    eps = EPS * exact.abs().max().item()
    ratio = err_fast / err_emulated if err_emulated > 0 else float("inf")
    assert err_fast <= 2 * err_emulated + eps, (
        f"{what}: max|fast - exact| {err_fast:.3g} is {ratio:.2f}x max|emulated - exact| "
        f"{err_emulated:.3g} (at most 2x + {eps:.3g} allowed)"
    )


def _emulating_twin(module: torch.nn.Module) -> torch.nn.Module:
    twin = copy.deepcopy(module)
    for m in twin.modules():
        if isinstance(m, GemmModule):
            m.use_reference = True  # its GEMMs only: attention and norms keep their path
    return twin


def _step(module, x, grad, r, steps=2):
    """`steps` steps on the same input `x` and output gradient `grad` (shaped as the output):
    FP8 under recipe `r` (the last on delayed scales from the first), or none with `r=None`.
    Returns the last output, the input's gradient and every parameter's, by name."""
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        inp = x.detach().clone().requires_grad_()
        fp8 = contextlib.nullcontext() if r is None else te.fp8_autocast(fp8_recipe=r)
        with fp8:
            out = module(inp)
        out.backward(grad)
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    return out, inp.grad, grads


def _compare(module, x, r_name):
    """The 2x rule (module docstring) for the output, the input gradient and every parameter
    gradient of `module` on `x`; returns the module and its emulating twin."""
    torch.manual_seed(0)
    twin = _emulating_twin(module)
    exact_module = copy.deepcopy(module).float()
    exact_module.use_reference = True  # plain PyTorch in fp32: no kernel's rounding in it
    grad = torch.randn_like(module(x))
    fast = _step(module, x, grad, RECIPES[r_name]())
    emulated = _step(twin, x, grad, RECIPES[r_name]())
    exact = _step(exact_module, x.float(), grad.float(), None, steps=1)
    assert fast[2].keys() == emulated[2].keys() == exact[2].keys()
    _within_2x(fast[0], emulated[0], exact[0], "output")
    _within_2x(fast[1], emulated[1], exact[1], "input gradient")
    for name, g in fast[2].items():
        _within_2x(g, emulated[2][name], exact[2][name], f"{name} gradient")
    return module, twin


def test_scaled_mm_matches_dequantized_product():
    """The compatibility wrapper's layouts and scales: `_scaled_mm` of two cast operands (a
    `[64, 128]`, b `[96, 128]`) equals their dequantized product `[64, 96]`, within the
    accumulation's precision."""
    torch.manual_seed(0)
    a = torch.randn(64, 128, device="cuda")
    b = torch.randn(96, 128, device="cuda")
    # Power-of-2 scales: the dequantized operands are exact even if fp32 matmuls use TF32.
    qa = quantize(a, torch.float8_e4m3fn, torch.tensor(32.0, device="cuda"))
    qb = quantize(b, torch.float8_e5m2, torch.tensor(512.0, device="cuda"))
    got = scaled_mm(qa.data, qb.data.t(), qa.scale_inv, qb.scale_inv, torch.float32)
    a_deq, b_deq = dequantize(qa).double(), dequantize(qb).double()
    want = a_deq @ b_deq.t()
    assert got.shape == want.shape
    # Not fp32-exact: Hopper's FP8 tensor cores keep about 14 significant bits while they
    # accumulate inside a WGMMA, before cuBLAS adds the partial sums in fp32 (DeepSeek-V3's
    # report measured this). Each of the K / 32 partial sums (4 here) may be off by a unit of 14
    # bits, 2^-13 of the magnitudes it sums: 4 x 2^-13 = 2^-11 of the sum of |products|. An
    # H200 (torch 2.11) was off by at most 0.012 here, where 2^-11 of the smallest sum of
    # |products| is about 0.026. A wrong scale (a factor of 32 or 512), a swapped operand or a
    # transposed layout is off by about the size of the result itself.
    bound = 2**-11 * (a_deq.abs() @ b_deq.abs().t()) + 1e-6
    err = (got.double() - want).abs()
    assert (err <= bound).all(), (
        f"{(err > bound).sum().item()}/{err.numel()} elements over the accumulation bound, "
        f"worst {(err / bound).max().item():.2f}x (max error {err.max().item():.3g})"
    )


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
    # Norms and activations may take kernels on one side and torch on the other; those bf16
    # differences are in both errors against exact, so the 2x rule needs no allowance for them.
    _compare(layer, x, r_name)


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
