"""kernels/_routes.py's `direct_apply`: an autograd.Function applied through autograd's C entry,
with the public `apply`'s results, gradients and functorch rules."""

from __future__ import annotations

import pytest
import torch
from fusedlayers.kernels import _routes, activation_ops, attention_ops, norm_ops, rope_ops

wrapped = torch._C._functorch.is_functorch_wrapped_tensor


class _Scale(torch.autograd.Function):
    """y = x * w * factor, saving both tensors; records whether forward saw a functorch wrapper."""

    saw_wrapper: list[bool] = []

    @staticmethod
    def forward(ctx, x, w, factor):
        _Scale.saw_wrapper.append(wrapped(x) or wrapped(w))
        ctx.save_for_backward(x, w)
        ctx.factor = factor
        return x * w * factor

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy * w * ctx.factor, dy * x * ctx.factor, None


def test_direct_apply_matches_the_public_apply():
    apply = _routes.direct_apply(_Scale)
    assert apply is not _Scale.apply  # this torch has the C entry: the direct path is tested
    x, w = (torch.randn(5, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dy = torch.randn(5, 3, dtype=torch.float64)
    got = apply(x, w, 1.5)
    want = _Scale.apply(x, w, 1.5)
    assert type(got.grad_fn) is type(want.grad_fn)
    torch.testing.assert_close(got, x.detach() * w.detach() * 1.5, rtol=0, atol=0)
    grads = torch.autograd.grad(got, (x, w), dy)
    torch.testing.assert_close(grads, (dy * w.detach() * 1.5, dy * x.detach() * 1.5))
    assert torch.autograd.gradcheck(lambda a, b: apply(a, b, 0.5), (x, w))


def test_direct_apply_unwraps_dead_functorch_wrappers():
    """A tensor that escaped a finished torch.func transform is a dead wrapper: the public
    apply unwraps it before forward runs, and so must the direct one (the C entry alone
    hands forward the wrapper)."""
    leaked = []

    def f(x):
        y = x * 2
        leaked.append(y)
        return y.sum()

    torch.func.grad(f)(torch.randn(4))
    (dead,) = leaked
    assert wrapped(dead)
    _Scale.saw_wrapper.clear()
    got = _routes.direct_apply(_Scale)(dead, torch.ones(4), 3.0)
    assert _Scale.saw_wrapper == [False]
    torch.testing.assert_close(got, _Scale.apply(dead, torch.ones(4), 3.0))


def test_direct_apply_defers_to_the_public_apply_under_a_transform():
    """Inside a transform the public apply decides: a Function without `setup_context` is
    refused with its message, not run on wrapped tensors."""
    apply = _routes.direct_apply(_Scale)
    with pytest.raises(RuntimeError, match="must override the setup_context"):
        torch.func.grad(lambda x: apply(x, torch.ones(3), 2.0).sum())(torch.randn(3))


def test_direct_apply_keeps_the_public_apply_for_a_setup_context_function():
    class WithSetup(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, dy):
            return dy * 2

    assert _routes.direct_apply(WithSetup) == WithSetup.apply


def test_eager_routes_apply_their_functions_directly(monkeypatch):
    """Every eager route takes the direct path, and an attention call with grad runs without
    the public apply's per-call unwrapping (which the direct path does in its place)."""
    routes = {
        attention_ops._apply_attention: attention_ops._EagerFlashAttention,
        norm_ops._apply_norm: norm_ops._EagerNorm,
        norm_ops._apply_add_norm: norm_ops._EagerAddNorm,
        rope_ops._apply_rope: rope_ops._EagerRope,
        rope_ops._apply_rope_pair: rope_ops._EagerRopePair,
        activation_ops._apply_activation: activation_ops._EagerActivation,
    }
    for apply, function in routes.items():
        assert apply != function.apply, function.__name__
    from torch._functorch import utils

    calls = []
    monkeypatch.setattr(utils, "unwrap_dead_wrappers", lambda args: calls.append(1) or args)
    q, k, v = (torch.randn(1, 16, 2, 16, requires_grad=True) for _ in range(3))
    out, _ = attention_ops.flash_attention(q, k, v, softmax_scale=0.25, window_size=(-1, 0))
    assert out.grad_fn is not None and not calls
