"""Eager routes around the torch.library custom ops.

torch.compile needs the custom ops (they are what it traces, with their fake implementations), but
an eager call pays for the dispatcher and for the op's autograd wrapper in host time. Measured on
a 2-core CPU with the attention launches stubbed out, inputs requiring grad: forward+backward
through `flash_attn_func` cost 303 us via the custom ops and ~95 us via `eager_function`'s
Function; a forward without grad 43 us via the op, 20 us as the bare launch. Small kernels are
launch-bound, so eager calls take the cheaper routes.
"""

from collections.abc import Callable

import torch


def direct_apply(function: type[torch.autograd.Function]) -> Callable:
    """`function.apply` through autograd's C entry, for a Function without `setup_context`.

    The public `apply` is a Python wrapper around that entry: it checks for `setup_context`,
    asks whether a functorch transform is active, then unwraps the arguments that are dead
    functorch wrappers in a generator, 2 us per call on a 2-core CPU (4 on the H100's host, a
    fifth of what a forward with grad adds to one without). This does the same two things in
    fewer steps: under a transform it hands the call to the public `apply`, which knows the
    rules; otherwise it unwraps every tensor argument as `apply` does and calls the entry.
    Where this torch lacks one of the three pieces, it is the public `apply` itself.
    """
    try:
        entry = super(torch.autograd.Function, function).apply
        transforms_active = torch._C._are_functorch_transforms_active
        unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    except AttributeError:
        return function.apply
    if function.setup_context is not torch.autograd.Function.setup_context:
        return function.apply  # the public apply binds such a Function's arguments first
    public, tensor = function.apply, torch.Tensor

    def apply(*args):
        if transforms_active():
            return public(*args)
        return entry(*[unwrap_if_dead(a) if isinstance(a, tensor) else a for a in args])

    return apply


def eager_function(
    name: str, forward: Callable, setup_context: Callable, backward: Callable
) -> type[torch.autograd.Function]:
    """An autograd.Function from a custom op's pieces: `forward(*inputs)` (the op's
    implementation), `setup_context(ctx, inputs, output)` and `backward(ctx, *grads)` (which
    should call the backward implementation directly, not its op).

    The Function takes ctx in forward and calls `setup_context` itself: a Function that defines
    `setup_context` separately has every `apply` bind its arguments with `inspect.signature`,
    ~110 us per call on a 2-core CPU, more than the dispatcher it replaces.
    """

    def forward_with_ctx(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward_with_ctx), "backward": staticmethod(backward)},
    )


def pick_forward(
    op: Callable,
    eager_apply: Callable,
    forward: Callable,
    tensors: tuple[torch.Tensor | None, ...],
) -> Callable:
    """The custom op under torch.compile (Dynamo sees is_compiling() as True and traces it); in
    eager, `eager_apply` (an autograd.Function's `apply`, taking the op's arguments) when one
    of `tensors` needs a gradient, else the bare `forward`."""
    if torch.compiler.is_compiling():
        return op
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return eager_apply
    return forward
