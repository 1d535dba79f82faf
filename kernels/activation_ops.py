"""The kernel entry `fused_activation`, as torch.library custom ops (the pattern of `norm_ops.py`).

Two ops, `fusedlayers::activation_fwd` and `fusedlayers::activation_bwd`, wrap the launchers of
`_activation.py`. Each has a fake (meta) implementation, so torch.compile(fullgraph=True) traces
through them, and the forward op carries its own autograd formula that calls the backward op.
Eager calls take the same formula as an autograd.Function, or the bare launch (kernels/_routes.py).

Shapes: x [..., w] -> y [..., w] (plain activations) or [..., w / 2] (gated), x's dtype,
contiguous. Only x is saved for the backward; it recomputes the activation.
"""

import torch

from ._activation import activation_backward, activation_forward, output_shape
from ._routes import direct_apply, eager_function, pick_forward

Tensor = torch.Tensor


def _forward_impl(x: Tensor, activation: str) -> Tensor:
    return activation_forward(x, activation)


activation_fwd = torch.library.custom_op("fusedlayers::activation_fwd", mutates_args=())(
    _forward_impl
)


@activation_fwd.register_fake
def _(x, activation) -> Tensor:
    return x.new_empty(output_shape(x.shape, activation))


def _backward_impl(dy: Tensor, x: Tensor, activation: str) -> Tensor:
    return activation_backward(dy, x, activation)


activation_bwd = torch.library.custom_op("fusedlayers::activation_bwd", mutates_args=())(
    _backward_impl
)


@activation_bwd.register_fake
def _(dy, x, activation) -> Tensor:
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output) -> None:
    x, activation = inputs
    ctx.save_for_backward(x)
    ctx.activation = activation


def _backward(ctx, dy, backward_op=activation_bwd):
    (x,) = ctx.saved_tensors
    return backward_op(dy, x, ctx.activation), None


activation_fwd.register_autograd(_backward, setup_context=_setup_context)
# Eager calls skip the dispatcher and the op's autograd wrapper (host time: see _routes.py).
_EagerActivation = eager_function(
    "_EagerActivation",
    _forward_impl,
    _setup_context,
    lambda ctx, dy: _backward(ctx, dy, backward_op=_backward_impl),
)
_apply_activation = direct_apply(_EagerActivation)


def fused_activation(x: Tensor, activation: str) -> Tensor:
    """TE's MLP activation `activation` of `x [..., w]`, forward and backward one kernel each, on
    validated input.

    Args:
        x: fp16/bf16/fp32 [..., w], last dim contiguous (else copied), rows of any stride; w even
            for a gated activation.
        activation: plain `gelu` (tanh form), `relu`, `qgelu`, `srelu`, `silu`, or gated
            `geglu`, `reglu`, `qgeglu`, `sreglu`, `swiglu` (act(x[..., :w/2]) * x[..., w/2:]).

    Returns:
        y [..., w] or [..., w / 2] (gated) in x's dtype, contiguous; differentiable in x.
    """
    forward = pick_forward(activation_fwd, _apply_activation, _forward_impl, (x,))
    return forward(x, activation)


__all__ = ["activation_bwd", "activation_fwd", "fused_activation"]
