"""The FP8 linear layer's three GEMMs, forward and backward, for every recipe.

    forward  y  [M, N] = x  [M, K] @ W^T       x cast as "input", W as "weight" (E4M3)
    dgrad    dx [M, K] = dy [M, N] @ W         dy cast as "grad_output" (E5M2 under HYBRID)
    wgrad    dW [N, K] = dy^T       @ x

(M tokens, K input features, N output features.) Each GEMM takes its operands as `[rows, inner]`
FP8 tensors, blocks along the inner dimension, so a 1x128-block operand is cast again from high
precision for the GEMM that contracts over its other dimension (per-tensor and 128x128 ones are
transposed as they are). The bias is added in fp32 before the output is rounded; its gradient is
summed from the high-precision dy.

Two ways to multiply, the same casts:
- CUDA, per-tensor scales (delayed, current): `torch._scaled_mm` (cuBLASLt FP8), fp32
  accumulation, fast accumulation in the forward GEMM only (TE's choice for delayed scaling; the
  recipe's MMParams for the others).
- emulation (`use_reference=True`, and block scaling on any device): dequantize and multiply in
  fp32 (on CUDA without `use_reference`, block scaling multiplies in the activation dtype).

FP8 shapes: K and N must be multiples of 16, and M too when the weight gradient is computed (it is
the wgrad GEMM's inner dimension); `check_gemm_shapes` raises `ArgumentError` otherwise, on every
path, so a shape the GPU would refuse fails in the CPU emulation as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ArgumentError
from ..recipe import BLOCK, Recipe
from ._torch_compat import scaled_mm, unviewed_reshape
from .meta import FP8Meta
from .scaling import (
    Quantized,
    amax,
    dequantize,
    fp8_dtype,
    fp8_max,
    quantize,
    quantize_blocks,
    scale_from_amax,
    transpose,
)
from .state import FP8Step

ALIGNMENT = 16  # cuBLASLt's FP8 GEMMs: every inner and output dimension a multiple of 16


@dataclass(slots=True)
class WeightOperands:
    """A weight cast once: `row` is W `[N, K]` (the forward GEMM's operand), `col` is W^T
    `[K, N]` (dgrad's), made when first needed. Kept across micro-batches by
    `is_first_microbatch` and by FP8 parameters."""

    row: Quantized
    col: Quantized | None = None


@dataclass(slots=True)
class GemmPlan:
    """What a GEMM needs that autograd does not track."""

    recipe: Recipe
    meta: FP8Meta
    gemm: int  # the GEMM's index within its module (TE's slot layout)
    emulate: bool
    out_dtype: torch.dtype
    where: str  # the module, for messages
    weight: WeightOperands | None = None  # already cast: skip casting the weight
    keep_weight: Callable[[WeightOperands], None] | None = None  # is_first_microbatch=True
    step: FP8Step | None = None  # its backward update runs after this GEMM's backward


def _qparams(recipe: Recipe, role: str):
    name = {"input": "fp8_quant_fwd_inp", "weight": "fp8_quant_fwd_weight"}.get(
        role, "fp8_quant_bwd_grad"
    )
    return getattr(recipe, name, None)


def block_shape(recipe: Recipe, role: str) -> tuple[int, int]:
    """Float8BlockScaling's block for `role`: 1x128 or 128x128 per the recipe's dims."""
    dims = {
        "input": recipe.x_block_scaling_dim,
        "weight": recipe.w_block_scaling_dim,
        "grad_output": recipe.grad_block_scaling_dim,
    }
    return (BLOCK, BLOCK) if dims[role] == 2 else (1, BLOCK)


def cast(t: torch.Tensor, role: str, plan: GemmPlan, record: bool = True) -> Quantized:
    """`t [rows, inner]` in FP8 for `role` ("input", "weight", "grad_output") under the plan's
    recipe; delayed scaling casts with this step's scale and records t's amax (`record`)."""
    recipe = plan.recipe
    dtype = fp8_dtype(recipe.fp8_format, backward=role == "grad_output")
    if recipe.float8_block_scaling():
        return quantize_blocks(t, dtype, block_shape(recipe, role), _qparams(recipe, role))
    t_amax = amax(t)
    if recipe.delayed():
        if record:
            plan.meta.record(plan.gemm, role, t_amax)
        return quantize(t, dtype, plan.meta.scale(plan.gemm, role))
    return quantize(t, dtype, scale_from_amax(t_amax, fp8_max(dtype), _qparams(recipe, role)))


def cast_transposed(q: Quantized, t: torch.Tensor, role: str, plan: GemmPlan) -> Quantized:
    """`t^T` in FP8 for the GEMM contracting over t's rows: `q` (t already cast) transposed,
    or for 1x128 blocks t^T cast again from high precision (amax not recorded twice)."""
    if q.block is None or q.block[0] == q.block[1]:
        return transpose(q)
    return cast(t.t(), role, plan, record=False)


def _fast_accum(recipe: Recipe, gemm: str) -> bool:
    if recipe.delayed():
        return gemm == "fprop"
    params = getattr(recipe, f"fp8_gemm_{gemm}", None)
    return params is not None and not params.use_split_accumulator


def matmul(
    a: Quantized,
    b: Quantized,
    out_dtype: torch.dtype,
    emulate: bool,
    fast_accum: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`a [M, K] @ b [N, K]^T (+ bias [N])` -> `[M, N]` in `out_dtype`."""
    bias = None if bias is None else bias.to(out_dtype)
    # Any torch.autocast around the layer must not lower the emulation's fp32 product.
    with torch.autocast(a.data.device.type, enabled=False):
        if emulate or a.block is not None or b.block is not None:
            compute = torch.float32 if emulate else out_dtype
            out = dequantize(a, compute) @ dequantize(b, compute).t()
            if bias is not None:
                out = out.float() + bias.float()
            return out.to(out_dtype)
        fuse = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
        out = scaled_mm(
            a.data, b.data.t(), a.scale_inv, b.scale_inv, out_dtype, bias if fuse else None,
            fast_accum,
        )  # fmt: skip
        return out if bias is None or fuse else out + bias


def check_gemm_shapes(tokens: int, weight: torch.Tensor, wgrad: bool, where: str) -> None:
    """Raise `ArgumentError` naming the shapes when an FP8 GEMM cannot take them."""
    n, k = weight.shape
    bad = [f"in_features K={k}"] if k % ALIGNMENT else []
    bad += [f"out_features N={n}"] if n % ALIGNMENT else []
    bad += [f"tokens M={tokens} (the weight gradient's inner dimension)"] if (
        wgrad and tokens % ALIGNMENT
    ) else []  # fmt: skip
    if bad:
        raise ArgumentError(
            f"{where}: FP8 GEMMs need dimensions that are multiples of {ALIGNMENT}; input "
            f"[M, K] = [{tokens}, {k}], weight [N, K] = [{n}, {k}]: {', '.join(bad)} is not. "
            "Pad the batch or sequence (M), or run this module outside fp8_autocast"
        )


class _FP8Linear(torch.autograd.Function):
    """`x [..., K] @ weight[N, K]^T + bias` with FP8 GEMMs forward and backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: GemmPlan):
        x2 = x.reshape(-1, x.shape[-1])
        x_row = cast(x2, "input", plan)
        w = plan.weight
        if w is None:
            w = WeightOperands(cast(weight, "weight", plan))
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if w.col is None and (need_dgrad or plan.keep_weight is not None):
            w.col = cast_transposed(w.row, weight, "weight", plan)
        if plan.keep_weight is not None:
            plan.keep_weight(w)
        fast = _fast_accum(plan.recipe, "fprop")
        out = matmul(x_row, w.row, plan.out_dtype, plan.emulate, fast, bias)
        ctx.plan = plan
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.w_col = w.col if need_dgrad else None
        ctx.x_col = cast_transposed(x_row, x2, "input", plan) if need_wgrad else None
        return unviewed_reshape(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.w_col is not None or ctx.x_col is not None:
            dy_row = cast(dy2, "grad_output", plan)
        if ctx.w_col is not None:
            fast = _fast_accum(plan.recipe, "dgrad")
            dx = matmul(dy_row, ctx.w_col, ctx.x_dtype, plan.emulate, fast).view(ctx.x_shape)
        if ctx.x_col is not None:
            dy_col = cast_transposed(dy_row, dy2, "grad_output", plan)
            fast = _fast_accum(plan.recipe, "wgrad")
            dw = matmul(dy_col, ctx.x_col, ctx.w_dtype, plan.emulate, fast)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(ctx.bias_dtype)
        ctx.w_col = ctx.x_col = None
        if plan.step is not None:
            plan.step.update_backward()
        return dx, dw, db, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: GemmPlan
) -> torch.Tensor:
    """`x [..., K]` -> `[..., N]` in `plan.out_dtype`, the GEMMs in FP8 (module docstring)."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    wgrad = torch.is_grad_enabled() and weight.requires_grad
    check_gemm_shapes(tokens, weight, wgrad, plan.where)
    return _FP8Linear.apply(x, weight, bias, plan)


__all__ = ["GemmPlan", "WeightOperands", "cast", "check_gemm_shapes", "fp8_linear", "matmul"]
