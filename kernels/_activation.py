"""MLP activations (TransformerEngine's set) forward and backward: Triton kernels and launchers.

Shapes: x [..., w] is flattened to [m, w] rows (a view when the leading dims collapse, else a
copy; the last dim must be contiguous, rows may have any stride).
    plain  (gelu, relu, qgelu, srelu, silu)        x [m, n]  -> y [m, n];   dy [m, n] -> dx [m, n]
    gated  (geglu, reglu, qgeglu, sreglu, swiglu)  x [m, 2n] -> y [m, n];   dy [m, n] -> dx [m, 2n]
A gated activation splits x into a = x[:, :n] and b = x[:, n:] and computes y = act(a) * b, with
    dx[:, :n] = dy * b * act'(a),   dx[:, n:] = dy * act(a).

The activations (fusedlayers/layers/mlp.py holds the PyTorch definitions these match):
    gelu(x)  = 0.5 x (1 + tanh(k0 (x + 0.044715 x^3)))  = x * sigmoid(2 k0 (x + 0.044715 x^3))
    qgelu(x) = x * sigmoid(1.702 x),  silu(x) = x * sigmoid(x)
    relu(x)  = max(x, 0),             srelu(x) = relu(x)^2
Math is fp32 whatever x's dtype, rounded once to x's dtype at the store. The backward recomputes
act(a) from the saved x instead of reading a saved y: one tensor less to keep between the passes.

Each program owns a BLOCK_M x BLOCK_N tile of one half (rows x output columns); the grid covers
rows on axis 0 and column blocks on axis 1. Elementwise and bandwidth bound: the tile is sized
for ~16 values per thread, i.e. 16-byte vector loads with a few in flight per thread.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import cdiv, empty, next_pow2, planned, rows_in_place, rows_view
from ._launch import PlannedLaunch, call_signature, launch_planned, launch_slot

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# TE activation name -> (the elementwise activation, gated?)
ACTIVATIONS: dict[str, tuple[str, bool]] = {
    "gelu": ("gelu", False),
    "relu": ("relu", False),
    "qgelu": ("qgelu", False),
    "srelu": ("srelu", False),
    "silu": ("silu", False),
    "geglu": ("gelu", True),
    "reglu": ("relu", True),
    "qgeglu": ("qgelu", True),
    "sreglu": ("srelu", True),
    "swiglu": ("silu", True),
}

# Tile geometry on CUDA: BLOCK_N up to 1024 contiguous columns, BLOCK_M rows to make ~2048
# elements per half, 4 warps, so each thread holds 16 values per loaded tensor (two 16-byte bf16
# loads). The interpreter gets small tiles so test-sized inputs span several row and column
# blocks, with ragged last blocks on both axes.
_CUDA_TILE, _CUDA_MAX_BLOCK_N, _CUDA_WARPS = 2048, 1024, 4
_INTERPRETER_TILE, _INTERPRETER_MAX_BLOCK_N = 128, 32

GELU_K0 = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
GELU_K1 = tl.constexpr(0.044715)
QGELU_K = tl.constexpr(1.702)


@triton.jit
def _sigmoid_pair(z):
    """(sigmoid(z), 1 - sigmoid(z)) of an fp32 tile, both to full relative precision.

    With e = exp(-|z|) in (0, 1] nothing overflows, and the smaller of the two is e / (1 + e)
    rather than 1 - (a number near 1), which would cancel: the derivatives below multiply
    1 - sigmoid by x, so its absolute error would grow with |x|.
    """
    e = tl.exp(-tl.abs(z))
    large = 1.0 / (1.0 + e)
    small = e * large
    positive = z >= 0
    return tl.where(positive, large, small), tl.where(positive, small, large)


@triton.jit
def _act_with_grad(x, ACTIVATION: tl.constexpr):
    """(act(x), act'(x)) of an fp32 tile. The forward drops the derivative (dead code for the
    compiler), so both passes compute act(x) with the same instructions."""
    if ACTIVATION == "relu":
        # where(x < 0) rather than maximum: NaN stays NaN, as with torch.relu. The derivative is
        # 0 at x <= 0 (torch's relu backward masks where relu(x) <= 0, so relu'(0) = 0) and 1
        # elsewhere, NaN included (torch passes dy through there).
        y = tl.where(x < 0, 0.0, x)
        dydx = tl.where(x <= 0, 0.0, 1.0)
    elif ACTIVATION == "srelu":
        r = tl.where(x < 0, 0.0, x)
        y = r * r
        dydx = 2.0 * r  # 0 at x = 0, as torch's relu(x).square() gives
    else:
        # x * sigmoid(z(x)) for all three: d/dx = s + x * s * (1 - s) * z'(x).
        if ACTIVATION == "silu":
            z = x
            dzdx = tl.full(x.shape, 1.0, tl.float32)
        elif ACTIVATION == "qgelu":
            z = QGELU_K * x
            dzdx = tl.full(x.shape, QGELU_K, tl.float32)
        else:
            tl.static_assert(ACTIVATION == "gelu", "unknown activation")
            # 0.5 (1 + tanh(u)) = sigmoid(2u): no tanh, and no cancellation where tanh is near -1.
            x2 = x * x
            z = (2.0 * GELU_K0) * x * (1.0 + GELU_K1 * x2)
            dzdx = (2.0 * GELU_K0) * (1.0 + (3.0 * GELU_K1) * x2)
        s, one_minus_s = _sigmoid_pair(z)
        y = x * s
        dydx = s + x * s * one_minus_s * dzdx
    return y, dydx


@triton.jit
def _act_fwd_kernel(
    X, Y,
    stride_xm, stride_ym,
    n_rows, n_cols,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y[r, c] = act(x[r, c]) (* x[r, n_cols + c] when GATED) for this program's tile.
    n_cols is y's width; a gated x row holds 2 * n_cols values."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    # int64 row offsets: rows * stride passes 2**31 elements at 16k rows x 2 * 64k columns.
    rows64 = rows.to(tl.int64)[:, None]
    x_ptrs = X + rows64 * stride_xm + cols[None, :]
    a = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    y, _ = _act_with_grad(a, ACTIVATION)
    if GATED:
        y = y * tl.load(x_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rows64 * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(
    X, DY, DX,
    stride_xm, stride_dym, stride_dxm,
    n_rows, n_cols,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx for this program's tile of y's columns: plain dx = dy * act'(x); gated
    dx[:, c] = dy * b * act'(a) and dx[:, n_cols + c] = dy * act(a), both halves in one pass."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x_ptrs = X + rows64 * stride_xm + cols[None, :]
    dx_ptrs = DX + rows64 * stride_dxm + cols[None, :]
    a = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows64 * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_with_grad(a, ACTIVATION)
    if GATED:
        b = tl.load(x_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptrs, (dy * b * dact).to(DX.dtype.element_ty), mask=mask)
        tl.store(dx_ptrs + n_cols, (dy * act).to(DX.dtype.element_ty), mask=mask)
    else:
        tl.store(dx_ptrs, (dy * dact).to(DX.dtype.element_ty), mask=mask)


def output_shape(x_shape: torch.Size | tuple[int, ...], activation: str) -> tuple[int, ...]:
    """y's shape: x's, with the last dim halved for a gated activation."""
    _base, gated = ACTIVATIONS[activation]
    return (*x_shape[:-1], x_shape[-1] // 2 if gated else x_shape[-1])


def _grid_and_blocks(n_rows: int, n_cols: int, device: torch.device) -> tuple[tuple, dict]:
    """(grid, launch keywords) for an output of [n_rows, n_cols]."""
    if device.type == "cuda":
        tile, max_block_n, warps = _CUDA_TILE, _CUDA_MAX_BLOCK_N, _CUDA_WARPS
    else:
        tile, max_block_n, warps = _INTERPRETER_TILE, _INTERPRETER_MAX_BLOCK_N, 1
    block_n = min(next_pow2(n_cols), max_block_n)
    block_m = max(1, tile // block_n)
    grid = (cdiv(n_rows, block_m), cdiv(n_cols, block_n))
    return grid, dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)


class _ActivationPlan(NamedTuple):
    """What an activation launch derives from its call's signature, once per signature: the
    launch, and whether the inputs are their own [m, n] row views (then they go to the kernel
    as they are; else `rows_view` copies them per call)."""

    launch: PlannedLaunch
    rows_in_place: bool


# Plans by signature (`activation_forward`, `activation_backward`; `planned`).
_PLANS: dict[tuple, _ActivationPlan] = {}


def _plan(x: torch.Tensor, dy: torch.Tensor | None, activation: str) -> _ActivationPlan:
    """The forward's plan (dy None) or the backward's."""
    base, gated = ACTIVATIONS[activation]
    x2 = rows_view(x, x.shape[-1])
    n_rows = x2.shape[0]
    if dy is None:
        n_cols = output_shape(x.shape, activation)[-1]
        ints = (x2.stride(0), n_cols, n_rows, n_cols)
    else:
        n_cols = dy.shape[-1]
        ints = (x2.stride(0), rows_view(dy, n_cols).stride(0), x.shape[-1], n_rows, n_cols)
    grid, blocks = _grid_and_blocks(n_rows, n_cols, x.device)
    launch = PlannedLaunch(grid, ints, dict(ACTIVATION=base, GATED=gated, **blocks), launch_slot())
    return _ActivationPlan(launch, rows_in_place(x, dy))


def _planned(x: torch.Tensor, dy: torch.Tensor | None, activation: str) -> tuple:
    """(plan, signature) of a forward (dy None) or backward call."""
    signature = call_signature((x, dy), (activation,))
    return planned(_PLANS, signature, (), lambda: _plan(x, dy, activation)), signature


def activation_forward(x: torch.Tensor, activation: str) -> torch.Tensor:
    """y = act(x) (gated: act of the first half times the second), contiguous in x's dtype.

    Assumes validated input: `activation` a key of ACTIVATIONS, x fp16/bf16/fp32 [..., w] with
    w even for a gated activation.
    """
    y = empty(output_shape(x.shape, activation), x.dtype, x.device)
    if y.numel() == 0:
        return y
    plan, signature = _planned(x, None, activation)
    if not plan.rows_in_place:
        x = rows_view(x, x.shape[-1])
    run = plan.launch
    launch_planned(_act_fwd_kernel, run, x, y, *run.ints, signature=signature)
    return y


def activation_backward(dy: torch.Tensor, x: torch.Tensor, activation: str) -> torch.Tensor:
    """dx [..., w] (x's shape, contiguous, x's dtype) from dy [..., n] (y's shape, any strides:
    copied only when its rows do not collapse to one stride or its last dim is strided) and the
    forward's input x."""
    dx = empty(x.shape, x.dtype, x.device)
    if dx.numel() == 0:
        return dx
    plan, signature = _planned(x, dy, activation)
    if not plan.rows_in_place:
        x, dy = rows_view(x, x.shape[-1]), rows_view(dy, dy.shape[-1])
    run = plan.launch
    launch_planned(_act_bwd_kernel, run, x, dy, dx, *run.ints, signature=signature)
    return dx
