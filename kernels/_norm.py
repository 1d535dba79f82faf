"""LayerNorm / RMSNorm forward and backward: Triton kernels and their launchers.

Shapes: x [..., n] is flattened to [m, n] rows (a view when the leading dims collapse, else a copy;
the last dim must be contiguous, rows may have any stride). weight, bias [n].
    forward   x [m, n] -> y [m, n] (x's dtype), mean [m] (fp32, LayerNorm only), rstd [m] (fp32)
    add+norm  x, residual [m, n] -> y = norm(h), h = x + residual [m, n] (x's dtype), mean, rstd
    backward  dy [m, n] -> dx [m, n] (x's dtype), dweight [n], dbias [n] (the parameters' dtypes)

    LayerNorm: y = (x - mean) * rstd * gamma + beta,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
    RMSNorm:   y = x * rstd * gamma (+ beta),         rstd = 1 / sqrt(mean(x^2) + eps)
gamma = weight, or weight + 1 with `zero_centered_gamma` (added in fp32, so a bf16 weight near 0
keeps its precision).

Each program owns BLOCK_M rows of BLOCK_N = next_pow2(n) columns, masked past n: a whole row sits
in registers, so every statistic is one in-register reduction and x is read once per pass. Small
hidden sizes pack several rows per program to keep each program's tile near `_FWD_TILE` /
`_BWD_TILE` elements.

The backward grid is a fixed number of programs, each walking a contiguous run of row blocks and
keeping fp32 dgamma/dbeta partials in registers; the partials [programs, n] are summed by torch
afterwards. No atomics and a partition that depends only on (m, device), so gradients are
bitwise reproducible.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import cdiv, empty, multiprocessors, next_pow2, planned, rows_in_place, rows_view
from ._launch import PlannedLaunch, call_signature, launch_planned, launch_slot

# Largest hidden size the one-row-in-registers kernels take. The 32-warp programs spill registers
# to local memory for the backward from 16384 and the forward at 65536 (sm_90 cubins): correct,
# slower. Larger rows would need a column loop; the front end sends them to the torch path.
MAX_HIDDEN = 65536
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (target elements per program tile, elements per warp); rows per program = tile // BLOCK_N.
# Forward: 16 values per thread (two 16-byte bf16 loads in flight each), ~56-80 registers.
# Backward: a larger tile, so small hidden sizes need fewer programs and fewer dgamma/dbeta
# partial rows to sum, but 8 values per thread: it holds x, dy and their products, and at 16 per
# thread ptxas needs ~120-140 registers, which leaves one program per SM (sm_90 cubins, read
# with cuobjdump -res-usage).
_FWD_TILE, _FWD_WARP_ELEMS = 2048, 512
_BWD_TILE, _BWD_WARP_ELEMS = 4096, 256
# Resident warps per SM the backward grid aims for: half of Hopper's 64, plenty for a streaming
# kernel whose every thread has its loads in flight, and half the partials of a full grid.
_BWD_WARPS_PER_SM = 32


@triton.jit
def _row_stats(x, cols_ok, inv_n, eps, IS_RMS: tl.constexpr):
    """(centered x, mean, rstd) of an fp32 tile [BLOCK_M, BLOCK_N]; padded columns of x are 0."""
    if IS_RMS:
        xc = x
        mean = tl.zeros([x.shape[0]], dtype=tl.float32)
    else:
        mean = tl.sum(x, axis=1) * inv_n
        # Padded columns would contribute mean^2 each to the variance: zero them again.
        xc = tl.where(cols_ok[None, :], x - mean[:, None], 0.0)
    # Two-pass variance (centered first): no cancellation of E[x^2] - mean^2 on offset rows.
    var = tl.sum(xc * xc, axis=1) * inv_n
    # Correctly rounded sqrt and division: the approximate ones cost ~2 ulp in fp32 outputs.
    # div_rn does not broadcast a scalar, hence the explicit tensor of ones.
    rstd = tl.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))
    return xc, mean, rstd


@triton.jit
def _norm_fwd_kernel(
    X, R, H, W, B, Y, Mean, Rstd,
    stride_xm, stride_rm, stride_ym,
    n_rows, n_cols, inv_n, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y = norm(x), or with HAS_RESIDUAL h = x + r (rounded to H's dtype, stored) and y = norm(h):
    the residual add a transformer block does before its next norm, in one pass. H and Y are
    contiguous [m, n] (row stride n_cols)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rows_ok = rows < n_rows
    cols_ok = cols < n_cols
    mask = rows_ok[:, None] & cols_ok[None, :]
    # int64 row offsets: m * stride passes 2**31 elements on large activations.
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        # Rounded as the separate add would round it, so the norm sees the same h.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + rows64[:, None] * stride_ym + cols[None, :], x, mask=mask)
    xc, mean, rstd = _row_stats(x.to(tl.float32), cols_ok, inv_n, eps, IS_RMS)

    w = tl.load(W + cols, mask=cols_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if not IS_RMS:
        tl.store(Mean + rows, mean, mask=rows_ok)
    tl.store(Rstd + rows, rstd, mask=rows_ok)


@triton.jit
def _norm_bwd_kernel(
    X, W, DY, DX, Mean, Rstd, DW_partial, DB_partial,
    stride_xm, stride_dym, stride_dxm,
    n_rows, n_cols, inv_n, blocks_per_program,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx per row in one pass; this program's dgamma/dbeta partials to row `pid` of the buffers.

    With xhat = (x - mean) * rstd (LayerNorm) or x * rstd (RMSNorm) and g = gamma * dy:
        LayerNorm: dx = rstd * (g - xhat * mean(g * xhat) - mean(g))
        RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
    dgamma = sum over rows of dy * xhat, dbeta = sum of dy (dweight = dgamma also when
    zero-centered, since gamma = weight + 1).
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cols_ok = cols < n_cols
    w = tl.load(W + cols, mask=cols_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = tl.where(cols_ok, w + 1.0, 0.0)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first_row = pid * blocks_per_program * BLOCK_M
    for i in range(0, blocks_per_program):
        rows = first_row + i * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_ok = rows < n_rows
        mask = rows_ok[:, None] & cols_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        # Rows past n_rows load rstd 0, so their xhat, dx and partial contributions are all 0.
        rstd = tl.load(Rstd + rows, mask=rows_ok, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(Mean + rows, mask=rows_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) * inv_n
        if IS_RMS:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, axis=1) * inv_n
            dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        dx_ptrs = DX + rows64[:, None] * stride_dxm + cols[None, :]
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(dy, axis=0)
    tl.store(DW_partial + pid * n_cols + cols, dw_acc, mask=cols_ok)
    if HAS_BIAS:
        tl.store(DB_partial + pid * n_cols + cols, db_acc, mask=cols_ok)


def _geometry(n_cols: int, tile: int, warp_elems: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of n_cols elements."""
    block_n = next_pow2(n_cols)
    block_m = max(1, tile // block_n)
    # 32 warps (1024 threads) is the hardware ceiling; beyond it each thread holds more values.
    num_warps = min(32, max(1, block_m * block_n // warp_elems))
    return block_m, block_n, num_warps


@functools.cache
def _backward_programs_cap(device: torch.device, num_warps: int) -> int:
    """How many backward programs to launch at most: enough to fill every SM to
    `_BWD_WARPS_PER_SM`, no more, since each program adds a partials row to sum. The interpreter
    gets a handful, enough to exercise several programs and several row blocks per program on
    test-sized inputs."""
    if device.type != "cuda":
        return 4
    return multiprocessors(device) * max(1, _BWD_WARPS_PER_SM // num_warps)


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [..., n] contiguous in x's dtype, mean [m] fp32 (empty [0] for RMSNorm), rstd [m] fp32).

    Assumes validated input: x fp16/bf16/fp32 with 0 < n <= MAX_HIDDEN, weight/bias [n].
    """
    y, _, mean, rstd = _forward(x, None, weight, bias, eps, rms, zero_centered_gamma)
    return y, mean, rstd


def add_norm_forward(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, mean, rstd): h = x + residual (contiguous, x's dtype, rounded as `x + residual`
    rounds) and y = norm(h), in one pass; mean and rstd as in `norm_forward`.

    Assumes validated input as `norm_forward`, and residual of x's shape, dtype and device.
    """
    return _forward(x, residual, weight, bias, eps, rms, zero_centered_gamma)


class _NormPlan(NamedTuple):
    """What a norm launch derives from its call's signature, once per signature: the launch,
    its row count, and whether the row-major inputs are their own [m, n] row views (then they
    go to the kernel as they are; else `rows_view` copies them per call)."""

    launch: PlannedLaunch
    n_rows: int
    rows_in_place: bool
    partials: tuple[int, int] | None = None  # the backward's dgamma/dbeta partials [programs, n]


# Plans by signature (`_forward`, `norm_backward`; `planned`).
_FWD_PLANS: dict[tuple, _NormPlan] = {}
_BWD_PLANS: dict[tuple, _NormPlan] = {}


def _forward_plan(x, residual, rms, zero_centered_gamma, has_bias, eps) -> _NormPlan:
    n_cols = x.shape[-1]
    x2 = rows_view(x, n_cols)
    r2 = None if residual is None else rows_view(residual, n_cols)
    n_rows = x2.shape[0]
    block_m, block_n, num_warps = _geometry(n_cols, _FWD_TILE, _FWD_WARP_ELEMS)
    ints = (
        x2.stride(0), x2.stride(0) if r2 is None else r2.stride(0), n_cols,
        n_rows, n_cols, 1.0 / n_cols, eps,
    )  # fmt: skip
    kwargs = dict(
        IS_RMS=rms, HAS_BIAS=has_bias, ZERO_CENTERED=zero_centered_gamma,
        HAS_RESIDUAL=r2 is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    grid = (cdiv(n_rows, block_m),)
    launch = PlannedLaunch(grid, ints, kwargs, launch_slot())
    return _NormPlan(launch, n_rows, rows_in_place(x, residual))


def _forward(x, residual, weight, bias, eps, rms, zero_centered_gamma):
    """The forward launch of `norm_forward` (residual None) and `add_norm_forward`."""
    signature = call_signature((x, residual, weight, bias), (eps, rms, zero_centered_gamma))
    plan = planned(
        _FWD_PLANS, signature, (),
        lambda: _forward_plan(x, residual, rms, zero_centered_gamma, bias is not None, eps),
    )  # fmt: skip
    y = empty(x.shape, x.dtype, x.device)
    h = None if residual is None else torch.empty_like(y)
    rstd = torch.empty(plan.n_rows, dtype=torch.float32, device=x.device)
    mean = rstd.new_empty(0 if rms else plan.n_rows)
    if plan.n_rows == 0:
        return y, h, mean, rstd
    if not plan.rows_in_place:
        n_cols = x.shape[-1]
        x = rows_view(x, n_cols)
        residual = None if residual is None else rows_view(residual, n_cols)
    run = plan.launch
    # Without a residual, x stands in for the pointers the kernel never reads.
    launch_planned(_norm_fwd_kernel, run,
        x, x if residual is None else residual, y if h is None else h, weight,
        weight if bias is None else bias, y, rstd if rms else mean, rstd, *run.ints,
        signature=signature,
    )  # fmt: skip
    return y, h, mean, rstd


def norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    rms: bool,
    zero_centered_gamma: bool,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx [..., n] contiguous in x's dtype, dweight [n] in weight's dtype, dbias [n] in
    `bias_dtype`, None without a bias). `mean`/`rstd` are the forward's."""
    has_bias = bias_dtype is not None
    signature = call_signature((x, weight, dy, mean, rstd), (rms, zero_centered_gamma, has_bias))
    plan = planned(
        _BWD_PLANS, signature, (), lambda: _backward_plan(dy, x, rms, zero_centered_gamma, has_bias)
    )
    dx = empty(x.shape, x.dtype, x.device)
    if plan.n_rows == 0:
        n_cols = x.shape[-1]
        dbias = torch.zeros(n_cols, dtype=bias_dtype, device=x.device) if has_bias else None
        return dx, torch.zeros_like(weight), dbias
    if not plan.rows_in_place:
        x, dy = rows_view(x, x.shape[-1]), rows_view(dy, dy.shape[-1])
    dw_partial = torch.empty(plan.partials, dtype=torch.float32, device=x.device)
    db_partial = torch.empty_like(dw_partial) if has_bias else dw_partial
    run = plan.launch
    launch_planned(_norm_bwd_kernel, run,
        x, weight, dy, dx, rstd if rms else mean, rstd, dw_partial, db_partial, *run.ints,
        signature=signature,
    )  # fmt: skip
    dweight = dw_partial.sum(0).to(weight.dtype)
    dbias = db_partial.sum(0).to(bias_dtype) if has_bias else None
    return dx, dweight, dbias


def _backward_plan(dy, x, rms, zero_centered_gamma, has_bias) -> _NormPlan:
    n_cols = x.shape[-1]
    x2, dy2 = rows_view(x, n_cols), rows_view(dy, n_cols)
    n_rows = x2.shape[0]
    block_m, block_n, num_warps = _geometry(n_cols, _BWD_TILE, _BWD_WARP_ELEMS)
    n_blocks = cdiv(n_rows, block_m)
    programs = min(n_blocks, _backward_programs_cap(x.device, num_warps))
    blocks_per_program = cdiv(n_blocks, programs) if programs else 0
    # Drop programs the rounding left without rows: then every launched program owns rows and
    # writes its whole partials row, so the buffers need no zero fill.
    programs = cdiv(n_blocks, blocks_per_program) if programs else 0
    ints = (x2.stride(0), dy2.stride(0), n_cols, n_rows, n_cols, 1.0 / n_cols, blocks_per_program)
    kwargs = dict(
        IS_RMS=rms, HAS_BIAS=has_bias, ZERO_CENTERED=zero_centered_gamma,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    launch = PlannedLaunch((programs,), ints, kwargs, launch_slot())
    return _NormPlan(launch, n_rows, rows_in_place(x, dy), (programs, n_cols))
