"""The kernel entry `layer_norm`, as torch.library custom ops (the pattern of `attention_ops.py`).

Three ops, `fusedlayers::norm_fwd`, `fusedlayers::add_norm_fwd` (a residual add fused into the
norm: `add_layer_norm`) and `fusedlayers::norm_bwd`, wrap the launchers of `_norm.py`.
Each has a fake (meta) implementation, so torch.compile(fullgraph=True) traces through them, and
the forward op carries its own autograd formula that calls the backward op. Eager calls take the
same formula as an autograd.Function, or the bare launch (kernels/_routes.py).

Shapes: x [..., n], weight [n], bias [n] or None -> y [..., n] in x's dtype, contiguous.
The saved statistics (mean, rstd: fp32 [m], m = x.numel() // n) are not differentiable.
"""

import torch

from ._norm import add_norm_forward, norm_backward, norm_forward
from ._routes import direct_apply, eager_function, pick_forward

Tensor = torch.Tensor


def _forward_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd); mean is empty [0] for RMSNorm."""
    return norm_forward(x, weight, bias, eps, rms, zero_centered_gamma)


norm_fwd = torch.library.custom_op("fusedlayers::norm_fwd", mutates_args=())(_forward_impl)


@norm_fwd.register_fake
def _(x, weight, bias, eps, rms, zero_centered_gamma) -> tuple[Tensor, Tensor, Tensor]:
    rows = x.numel() // x.shape[-1]
    rstd = x.new_empty(rows, dtype=torch.float32)
    return x.new_empty(x.shape), x.new_empty(0 if rms else rows, dtype=torch.float32), rstd


def _backward_impl(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    rms: bool,
    zero_centered_gamma: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias); dbias is empty [0] without a bias. `bias` only supplies its dtype."""
    dx, dweight, dbias = norm_backward(
        dy,
        x,
        weight,
        mean,
        rstd,
        rms,
        zero_centered_gamma,
        None if bias is None else bias.dtype,
    )
    return dx, dweight, x.new_empty(0) if dbias is None else dbias


norm_bwd = torch.library.custom_op("fusedlayers::norm_bwd", mutates_args=())(_backward_impl)


@norm_bwd.register_fake
def _(dy, x, weight, bias, *args) -> tuple[Tensor, Tensor, Tensor]:
    dbias = x.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), dbias


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _eps, rms, zero_centered_gamma = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.rms, ctx.zero_centered_gamma = rms, zero_centered_gamma


def _backward(ctx, dy, _dmean, _drstd, backward_op=norm_bwd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = backward_op(
        dy, x, weight, bias, mean, rstd, ctx.rms, ctx.zero_centered_gamma
    )
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    return (
        dx if needs_x else None,
        dweight if needs_weight else None,
        dbias if bias is not None and needs_bias else None,
        None,
        None,
        None,
    )


norm_fwd.register_autograd(_backward, setup_context=_setup_context)
# Eager calls skip the dispatcher and the op's autograd wrapper (host time: see _routes.py).
_EagerNorm = eager_function(
    "_EagerNorm",
    _forward_impl,
    _setup_context,
    lambda ctx, dy, dmean, drstd: _backward(ctx, dy, dmean, drstd, backward_op=_backward_impl),
)
_apply_norm = direct_apply(_EagerNorm)


def layer_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    *,
    rms: bool,
    zero_centered_gamma: bool,
) -> Tensor:
    """LayerNorm (or RMSNorm with `rms=True`) of `x [..., n]` over its last dim, on validated input.

    Args:
        x: fp16/bf16/fp32 [..., n], 0 < n <= `_norm.MAX_HIDDEN`; any strides (rows that do not
            collapse to one stride, or a strided last dim, are copied first).
        weight: [n], any of those dtypes; gamma = weight (+ 1 when `zero_centered_gamma`, TE's
            convention: the stored weight is gamma - 1).
        bias: [n] or None; added after scaling (RMSNorm takes one too, though TE's has none).
        eps: added to the variance (LayerNorm) or the mean square (RMSNorm).

    Returns:
        y [..., n] in x's dtype, contiguous; differentiable in x, weight and bias, with
        deterministic gradients (dweight/dbias in the parameters' dtypes).
    """
    forward = pick_forward(norm_fwd, _apply_norm, _forward_impl, (x, weight, bias))
    y, _mean, _rstd = forward(x, weight, bias, float(eps), bool(rms), bool(zero_centered_gamma))
    return y


def _add_forward_impl(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    zero_centered_gamma: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, h, mean, rstd) with h = x + residual and y = norm(h)."""
    return add_norm_forward(x, residual, weight, bias, eps, rms, zero_centered_gamma)


add_norm_fwd = torch.library.custom_op("fusedlayers::add_norm_fwd", mutates_args=())(
    _add_forward_impl
)


@add_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, rms, zero_centered_gamma):
    rows = x.numel() // x.shape[-1]
    rstd = x.new_empty(rows, dtype=torch.float32)
    mean = x.new_empty(0 if rms else rows, dtype=torch.float32)
    return x.new_empty(x.shape), x.new_empty(x.shape), mean, rstd


def _add_setup_context(ctx, inputs, output) -> None:
    _x, _residual, weight, bias, _eps, rms, zero_centered_gamma = inputs
    _y, h, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(h, weight, bias, mean, rstd)
    ctx.rms, ctx.zero_centered_gamma = rms, zero_centered_gamma


def _add_backward(ctx, dy, dh, _dmean, _drstd, backward_op=norm_bwd):
    """The norm's backward on h, plus h's own gradient; x and residual both get the sum."""
    h, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = backward_op(
        dy, h, weight, bias, mean, rstd, ctx.rms, ctx.zero_centered_gamma
    )
    if dh is not None:
        dx = dx + dh
    needs_x, needs_residual, needs_weight, needs_bias = ctx.needs_input_grad[:4]
    return (
        dx if needs_x else None,
        dx if needs_residual else None,
        dweight if needs_weight else None,
        dbias if bias is not None and needs_bias else None,
        None,
        None,
        None,
    )


add_norm_fwd.register_autograd(_add_backward, setup_context=_add_setup_context)
_EagerAddNorm = eager_function(
    "_EagerAddNorm",
    _add_forward_impl,
    _add_setup_context,
    lambda ctx, dy, dh, dmean, drstd: _add_backward(
        ctx, dy, dh, dmean, drstd, backward_op=_backward_impl
    ),
)
_apply_add_norm = direct_apply(_EagerAddNorm)


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    *,
    rms: bool,
    zero_centered_gamma: bool,
) -> tuple[Tensor, Tensor]:
    """`(layer_norm(h), h)` with `h = x + residual`, in one kernel pass, on validated input.

    x and residual: [..., n] of one shape, dtype and device (any strides, as `layer_norm`'s x);
    the rest as `layer_norm`. h is rounded to x's dtype as `x + residual` rounds it, so y equals
    `layer_norm(x + residual)` bit for bit. Both outputs are contiguous and differentiable; x
    and residual get the same gradient.
    """
    forward = pick_forward(
        add_norm_fwd, _apply_add_norm, _add_forward_impl, (x, residual, weight, bias)
    )
    y, h, _mean, _rstd = forward(
        x, residual, weight, bias, float(eps), bool(rms), bool(zero_centered_gamma)
    )
    return y, h


__all__ = ["add_layer_norm", "layer_norm", "norm_fwd", "add_norm_fwd", "norm_bwd"]
