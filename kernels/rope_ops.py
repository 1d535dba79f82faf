"""The kernel entry `rope`, as torch.library custom ops (the pattern of `norm_ops.py`).

Two ops, `fusedlayers::rope_fwd` and `fusedlayers::rope_bwd`, wrap `_rope.rotate` (the forward
rotation and its transpose). Each has a fake (meta) implementation, so torch.compile
(fullgraph=True) traces through them, and the forward op carries its own autograd formula that
calls the backward op. Eager calls take the same formula as an autograd.Function, or the bare
launch (kernels/_routes.py).

Shapes: t [s, b, h, d] (`seq_dim=0`), [b, s, h, d] (`seq_dim=1`) or [t, h, d]; cos, sin fp32
[n_pos, d_rot]; positions None or int [s, b] / [b, s] / [t] -> out of t's shape and dtype,
contiguous. Only t gets a gradient: the tables and positions are constants to the kernel.
"""

import torch

from ._rope import rotate
from ._routes import direct_apply, eager_function, pick_forward

Tensor = torch.Tensor


def _forward_impl(
    t: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor | None,
    seq_dim: int,
    interleaved: bool,
) -> Tensor:
    return rotate((t,), cos, sin, positions, seq_dim, interleaved, inverse=False)[0]


rope_fwd = torch.library.custom_op("fusedlayers::rope_fwd", mutates_args=())(_forward_impl)


@rope_fwd.register_fake
def _(t, cos, sin, positions, seq_dim, interleaved) -> Tensor:
    return t.new_empty(t.shape)


def _backward_impl(
    dout: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor | None,
    seq_dim: int,
    interleaved: bool,
) -> Tensor:
    """dt = the transpose of the rotation applied to `dout` (any strides)."""
    return rotate((dout,), cos, sin, positions, seq_dim, interleaved, inverse=True)[0]


rope_bwd = torch.library.custom_op("fusedlayers::rope_bwd", mutates_args=())(_backward_impl)


@rope_bwd.register_fake
def _(dout, cos, sin, positions, seq_dim, interleaved) -> Tensor:
    return dout.new_empty(dout.shape)


def _setup_context(ctx, inputs, output) -> None:
    _t, cos, sin, positions, seq_dim, interleaved = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.seq_dim, ctx.interleaved = seq_dim, interleaved


def _backward(ctx, dout, backward_op=rope_bwd):
    cos, sin, positions = ctx.saved_tensors
    dt = None
    if ctx.needs_input_grad[0]:
        dt = backward_op(dout, cos, sin, positions, ctx.seq_dim, ctx.interleaved)
    return dt, None, None, None, None, None


rope_fwd.register_autograd(_backward, setup_context=_setup_context)
# Eager calls skip the dispatcher and the op's autograd wrapper (host time: see _routes.py).
_EagerRope = eager_function(
    "_EagerRope",
    _forward_impl,
    _setup_context,
    lambda ctx, dout: _backward(ctx, dout, backward_op=_backward_impl),
)
_apply_rope = direct_apply(_EagerRope)


def rope(
    t: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor | None = None,
    *,
    seq_dim: int,
    interleaved: bool,
) -> Tensor:
    """Rotary position embedding of `t` on validated input.

    Args:
        t: fp16/bf16/fp32 `[s, b, h, d]` (seq_dim 0), `[b, s, h, d]` (seq_dim 1) or `[t, h, d]`
            (thd: needs `positions`), any strides with stride(-1) == 1 (read in place).
        cos, sin: fp32 `[n_pos, d_rot]` on t's device, cos and sin of the angle table; d_rot even
            and <= d. Channels d_rot..d pass through.
        positions: None (each token's position is its index along `seq_dim`, 0..s-1) or an int
            tensor of t's leading shape (`[s, b]`, `[b, s]`, `[t]`), every entry < n_pos.
        interleaved: pair channels (2j, 2j+1) instead of (j, j + d_rot/2).

    Returns:
        out of t's shape and dtype, contiguous; differentiable in t only.
    """
    forward = pick_forward(rope_fwd, _apply_rope, _forward_impl, (t,))
    return forward(t, cos, sin, positions, int(seq_dim), bool(interleaved))


def _pair_forward_impl(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor | None,
    seq_dim: int,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    return rotate((q, k), cos, sin, positions, seq_dim, interleaved, inverse=False)


def _pair_setup_context(ctx, inputs, output) -> None:
    _q, _k, cos, sin, positions, seq_dim, interleaved = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.seq_dim, ctx.interleaved = seq_dim, interleaved


def _pair_backward(ctx, dq_out, dk_out):
    cos, sin, positions = ctx.saved_tensors
    # Autograd hands a zero tensor for an output without a gradient; the attention backward's
    # two gradients often lie in one buffer, which the pair launch reads in place.
    dq, dk = rotate(
        (dq_out, dk_out), cos, sin, positions, ctx.seq_dim, ctx.interleaved, inverse=True
    )
    needs_q, needs_k = ctx.needs_input_grad[:2]
    return dq if needs_q else None, dk if needs_k else None, None, None, None, None, None


_EagerRopePair = eager_function(
    "_EagerRopePair", _pair_forward_impl, _pair_setup_context, _pair_backward
)
_apply_rope_pair = direct_apply(_EagerRopePair)


def _pair_as_ops(q, k, cos, sin, positions, seq_dim, interleaved) -> tuple[Tensor, Tensor]:
    """Under torch.compile: the one-tensor op twice (what Inductor traces and fuses)."""
    return (
        rope_fwd(q, cos, sin, positions, seq_dim, interleaved),
        rope_fwd(k, cos, sin, positions, seq_dim, interleaved),
    )


def rope_pair(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor | None = None,
    *,
    seq_dim: int,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    """`rope(q, ...)` and `rope(k, ...)` with one launch each way and one autograd node.

    q and k as `rope`'s t, with the same leading (token) dims, dtype, device and head dim, any
    head counts (self-attention's q and k; GQA's k has fewer heads): one table and one set of
    positions serve both. Returns (q_out, k_out), contiguous, back to back in one buffer.
    Eager calls save the host a Function and a launch per pass against two `rope` calls; under
    torch.compile it is the two ops.
    """
    forward = pick_forward(_pair_as_ops, _apply_rope_pair, _pair_forward_impl, (q, k))
    return forward(q, k, cos, sin, positions, int(seq_dim), bool(interleaved))


__all__ = ["rope", "rope_bwd", "rope_fwd", "rope_pair"]
