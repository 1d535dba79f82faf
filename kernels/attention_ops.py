"""The kernel entry `flash_attention`, as torch.library custom ops.

Two ops, `fusedlayers::flash_attn_fwd` and `fusedlayers::flash_attn_bwd`, wrap the Triton
launchers. Each has a fake (meta) implementation, so torch.compile traces through them without a
graph break, and the forward op carries its own autograd formula that calls the backward op.
Eager calls take the same formula as an autograd.Function, or the bare launch when no gradient
is needed: the dispatcher costs host time (kernels/_routes.py).

Shapes (docs/internals.md):
    dense   q [b, s_q, h_q, d_qk], k [b, s_k, h_kv, d_qk], v [b, s_k, h_kv, d_v]
            -> out [b, s_q, h_q, d_v] (dtype of q; bf16 for fp8), lse [b, h_q, s_q] (fp32, ln)
    varlen  q [t_q, h_q, d_qk], k [t_k, h_kv, d_qk], v [t_k, h_kv, d_v]
            -> out [t_q, h_q, d_v], lse [h_q, t_q]
The ops' outputs and gradients are always contiguous: the fake implementations promise exactly
that, and the real ones make it true whatever buffers the launchers allocate. The eager route
differs in one way: q/k/v that are views tiling one packed buffer get their gradients as views of
one new buffer laid out the same way (kernels/_packed.py), so the packed gradient needs no copy.
The LSE is differentiable too, on every route that can return it with a gradient (the op's
autograd formula, the eager Function with or without a `PlannedCall`): its upstream gradient
`dlse` (the backward op's last argument) is folded into the backward's delta = rowsum(dO * O),
which is exactly its contribution (`_flash_bwd.flash_attention_backward`). A loss that does
not read the LSE passes no dlse, and its backward launches as before.
FP8 (float8_e4m3fn q, k, v) is forward only: `flash_attention` refuses inputs that require
grad, so fp8 calls take the bare launch in eager and the forward op under torch.compile, with
their descales as the op's last argument (`_fp8_descale`); they never reach a backward.
"""

import inspect
import operator
from typing import NamedTuple

import torch

from . import _compat
from ._common import attention_signature, seed_offset
from ._flash_bwd import flash_attention_backward
from ._flash_fwd import FP8_DTYPE, flash_attention_forward, output_dtype
from ._launch import tensor_signature
from ._packed import packed_grad_buffers, plan_packed_grads
from ._routes import direct_apply, pick_forward

Tensor = torch.Tensor

# Seeds and offsets are drawn below 2**31: Triton passes such ints as i32, so every draw reuses
# one compiled kernel (a larger value would specialize an i64 variant).
_RNG_BOUND = 2**31 - 1


def _fwd_shapes(q: Tensor, v: Tensor, varlen: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(out shape, lse shape) for dense [b, s, h, d] or varlen [t, h, d] inputs."""
    out_shape = (*q.shape[:-1], v.shape[-1])
    if varlen:
        return out_shape, (q.shape[1], q.shape[0])
    return out_shape, (q.shape[0], q.shape[2], q.shape[1])


def _forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    seq_offsets_q: Tensor | None,
    seq_offsets_k: Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    seqlens_q: Tensor | None,
    seqlens_k: Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    bias: Tensor | None,
    alibi_slopes: Tensor | None,
    softcap: float,
    dropout_p: float,
    rng_state: Tensor | None,
    deterministic: bool,
    descale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Forward attention: (out, lse). `deterministic` only travels to the backward. `descale`:
    fp8 inputs' fp32 [b, h_kv, 3] (`_fp8_descale`), or None."""
    return _launch_forward(q, k, v, _launch_keywords(**locals()))  # every parameter, by name


def _launch_keywords(
    q: Tensor, k: Tensor, v: Tensor, *, rng_state: Tensor | None, deterministic: bool, **options
) -> dict:
    """`flash_attention_forward`'s keywords after q, k and v, from `_forward_impl`'s arguments
    by name (`options`: all but the five named here): the options, the seed and offset, and the
    call's `attention_signature`, which the eager route hands to its backward so the launch
    plans there start from it."""
    seed, offset = seed_offset(rng_state)
    signature = attention_signature(q, k, v, **options, seed=seed, offset=offset)
    return dict(options, seed=seed, offset=offset, signature=signature)


def _launch_forward(q: Tensor, k: Tensor, v: Tensor, launch: dict) -> tuple[Tensor, Tensor]:
    """The forward launch of the op and the eager routes: (out, lse). `launch`: from
    `_launch_keywords`, or a `PlannedCall`'s."""
    out, lse = flash_attention_forward(q, k, v, **launch)
    # A launcher may hand back views of larger buffers; the fake promises contiguous outputs.
    return out.contiguous(), lse.contiguous()


flash_attn_fwd = torch.library.custom_op("fusedlayers::flash_attn_fwd", mutates_args=())(
    _forward_impl
)


@flash_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, *args) -> tuple[Tensor, Tensor]:
    out_shape, lse_shape = _fwd_shapes(q, v, cu_seqlens_q is not None)
    return (
        q.new_empty(out_shape, dtype=output_dtype(q.dtype)),
        q.new_empty(lse_shape, dtype=torch.float32),
    )


def _backward_impl(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    seq_offsets_q: Tensor | None,
    seq_offsets_k: Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    seqlens_q: Tensor | None,
    seqlens_k: Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    bias: Tensor | None,
    bias_requires_grad: bool,
    alibi_slopes: Tensor | None,
    softcap: float,
    dropout_p: float,
    rng_state: Tensor | None,
    deterministic: bool,
    dlse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward attention: (dq, dk, dv, dbias); dbias is empty [0] unless `bias_requires_grad`.
    `dlse`: the LSE's upstream gradient (the LSE's shape), None when the loss does not read it.

    dbias, when asked for, has the shape of `bias` ([b, h_q, s_q, s_k], before autograd sums it
    over the broadcast dims of the expanded view the caller passed). dq, dk, dv are new
    contiguous tensors: a custom op's outputs may not alias each other.
    """
    dq, dk, dv, dbias = _launch_backward(**locals())  # every parameter above, by name
    return (
        dq.to(q.dtype).contiguous(),
        dk.to(k.dtype).contiguous(),
        dv.to(v.dtype).contiguous(),
        dbias,
    )


def _launch_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    bias: Tensor | None,
    bias_requires_grad: bool,
    rng_state: Tensor | None,
    **options,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's backward launch: `options` are `_backward_impl`'s remaining arguments. (The
    eager route calls `flash_attention_backward` itself, with keywords its forward gathered.)"""
    seed, offset = seed_offset(rng_state)
    dq, dk, dv, dbias = flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        bias=bias,
        bias_requires_grad=bias_requires_grad,
        seed=seed,
        offset=offset,
        **options,
    )
    if bias_requires_grad:
        dbias = dbias.reshape(bias.shape).to(bias.dtype).contiguous()
    else:
        dbias = q.new_empty(0)
    return dq, dk, dv, dbias


flash_attn_bwd = torch.library.custom_op("fusedlayers::flash_attn_bwd", mutates_args=())(
    _backward_impl
)
_BWD_SIGNATURE = inspect.signature(_backward_impl)


@flash_attn_bwd.register_fake
def _(dout, q, k, v, *args, **kwargs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    named = _BWD_SIGNATURE.bind(dout, q, k, v, *args, **kwargs).arguments
    bias, bias_requires_grad = named["bias"], named["bias_requires_grad"]
    dbias = bias.new_empty(bias.shape) if bias_requires_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


# The backward hands back one gradient per forward argument, in this order.
_FWD_ARGS = tuple(inspect.signature(_forward_impl).parameters)
_TENSOR_INPUTS = (
    "q",
    "k",
    "v",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "seq_offsets_q",
    "seq_offsets_k",
    "seqlens_q",
    "seqlens_k",
    "bias",
    "alibi_slopes",
    "rng_state",
)
assert _TENSOR_INPUTS[-1] == "rng_state"  # the eager backward leaves the last one out
_SCALAR_INPUTS = (
    "max_seqlen_q",
    "max_seqlen_k",
    "softmax_scale",
    "window_left",
    "window_right",
    "bottom_right",
    "softcap",
    "dropout_p",
    "deterministic",
)


# Positions in the forward's inputs of what the backward needs, and the gradients it hands back
# around dq, dk, dv and dbias (None for every other input).
_SAVED_TENSORS = operator.itemgetter(*(_FWD_ARGS.index(name) for name in _TENSOR_INPUTS))
_SAVED_SCALARS = operator.itemgetter(*(_FWD_ARGS.index(name) for name in _SCALAR_INPUTS))
_BIAS = _FWD_ARGS.index("bias")
_NO_GRADS = ((None,) * (_BIAS - 3), (None,) * (len(_FWD_ARGS) - _BIAS - 1))


def _setup_context(ctx, inputs, output) -> None:
    out, lse = output
    # An output the loss does not read gets None in the backward, not a tensor of zeros: a loss
    # on out alone passes no dlse (no zero fill of lse's size, no dlse work in the kernels).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(out, lse, *_SAVED_TENSORS(inputs))
    ctx.scalars = dict(zip(_SCALAR_INPUTS, _SAVED_SCALARS(inputs)))
    bias = inputs[_BIAS]
    ctx.bias_requires_grad = bias is not None and bias.requires_grad


def _backward(ctx, dout, dlse, backward_op=flash_attn_bwd):
    out, lse, *saved = ctx.saved_tensors
    tensors = dict(zip(_TENSOR_INPUTS, saved))
    dq, dk, dv, dbias = backward_op(
        # Autograd may pass an expanded (stride 0) gradient; the kernels need stride(-1) == 1.
        _dout(dout, out),
        tensors.pop("q"),
        tensors.pop("k"),
        tensors.pop("v"),
        out,
        lse,
        bias_requires_grad=ctx.bias_requires_grad,
        **tensors,
        **ctx.scalars,
        dlse=dlse,
    )
    dbias = dbias if ctx.bias_requires_grad else None
    return (dq, dk, dv, *_NO_GRADS[0], dbias, *_NO_GRADS[1])  # one per forward input


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _dout(dout: Tensor | None, out: Tensor) -> Tensor:
    """out's upstream gradient as the kernels read it: contiguous (autograd may pass an expanded,
    stride-0 one), and zeros where the loss reads only the LSE (None: not materialized)."""
    return torch.zeros_like(out) if dout is None else dout.contiguous()


class _EagerFlashAttention(torch.autograd.Function):
    """The eager route (host time: see _routes.py), taken where a gradient is needed.

    `apply(q, k, v, bias, args, planned)`, `args` being `_forward_impl`'s whole argument list
    and `planned` the call's `PlannedCall` or None: autograd tracks the four tensors that can
    have a gradient and passes the rest through, so its per-input work covers six arguments
    rather than twenty-two. A planned call brings its launch and backward keywords along;
    other calls build them here. Autograd runs the
    backward on its device thread, where the same Python takes longer than on the caller's
    (docs/performance.md, "Host time on autograd's device thread"), so the forward gathers what
    the backward passes on: its keywords, the call's `attention_signature` (the backward's launch
    plans start from it) and the packed-gradient plan. Only this route shares one gradient buffer
    between packed q/k/v (kernels/_packed.py); the op keeps fresh outputs.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, args, planned):
        # An output the loss does not read gets None, not zeros: without this autograd would
        # allocate and zero-fill a gradient the size of lse for every backward of a loss on out
        # alone (an allocation and a kernel launch on its device thread), and the kernels would
        # fold those zeros into delta.
        ctx.set_materialize_grads(False)
        ctx.grad_plan = plan_packed_grads(q, k, v)
        if planned is not None:
            # No tensor arguments besides q, k and v (`plan_call`), so the backward's tensor
            # keywords all stay None, and its other keywords were made with the plan.
            out, lse = _launch_forward(q, k, v, planned.launch)
            ctx.save_for_backward(out, lse, q, k, v)
            ctx.bias_requires_grad = False
            ctx.options = planned.backward
            return out, lse
        launch = _launch_keywords(**dict(zip(_FWD_ARGS, args)))
        out, lse = _launch_forward(q, k, v, launch)
        _setup_context(ctx, args, (out, lse))
        ctx.options = _backward_keywords(ctx.scalars, launch, ctx.bias_requires_grad)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse, q, k, v, *saved = ctx.saved_tensors
        # The saved tensors after q, k and v, but rng_state (last): the forward read its seed.
        tensors = dict(zip(_TENSOR_INPUTS[3:-1], saved))
        # q/k/v tiling one packed buffer get their gradients as views of one new buffer.
        dq, dk, dv = packed_grad_buffers(ctx.grad_plan, q, k, v)
        dout = _dout(dout, out)
        options = ctx.options
        # out and lse came from this forward, dq/dk/dv from its packed-gradient plan: their
        # signatures follow from the forward's and the plan, so only dout's and dlse's (None
        # where the loss does not read the LSE) are new.
        signature = (
            tensor_signature(dout), tensor_signature(dlse), options["forward_signature"],
            ctx.grad_plan, options["bias_requires_grad"], options["deterministic"],
        )  # fmt: skip
        dq, dk, dv, dbias = flash_attention_backward(
            dout, q, k, v, out, lse, **tensors, **options, dq=dq, dk=dk, dv=dv, dlse=dlse,
            signature=signature,
        )  # fmt: skip
        if ctx.bias_requires_grad:
            bias = tensors["bias"]
            dbias = dbias.reshape(bias.shape).to(bias.dtype).contiguous()
        return dq, dk, dv, dbias, None, None


def _backward_keywords(scalars: dict, launch: dict, bias_requires_grad: bool) -> dict:
    """The eager backward's keywords for `flash_attention_backward` besides its tensors: the
    forward's scalar arguments (`_SCALAR_INPUTS`), and from its `launch` keywords the seed, the
    offset and the signature."""
    return dict(
        scalars, seed=launch["seed"], offset=launch["offset"],
        bias_requires_grad=bias_requires_grad, forward_signature=launch["signature"],
    )  # fmt: skip


_apply_attention = direct_apply(_EagerFlashAttention)


def _eager_apply(*args, planned: "PlannedCall | None" = None):
    """`_EagerFlashAttention.apply` on `_forward_impl`'s argument list; `planned`: the call's
    `PlannedCall`, where it has one."""
    return _apply_attention(args[0], args[1], args[2], args[_BIAS], args, planned)


def _planned_forward(*args, planned: "PlannedCall") -> tuple[Tensor, Tensor]:
    """The launch alone (no gradient needed) of a planned call, given its argument list."""
    return _launch_forward(args[0], args[1], args[2], planned.launch)


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    seq_offsets_q: Tensor | None = None,
    seq_offsets_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqlens_q: Tensor | None = None,
    seqlens_k: Tensor | None = None,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    bottom_right: bool = True,
    bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    deterministic: bool = False,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Flash attention on validated input; out and lse are differentiable in q, k, v and bias
    (fp8: forward only).

    Args:
        q, k, v: dense q [b, s_q, h_q, d_qk], k [b, s_k, h_kv, d_qk], v [b, s_k, h_kv, d_v], or
            varlen [t, h, d] with `cu_seqlens_*`; any strides with stride(-1) == 1 (packed views
            are read in place). Query head `i` reads KV head `i // (h_q // h_kv)`.
        cu_seqlens_q/k: varlen int32 [b+1] cumulative lengths; `seq_offsets_q/k` int32 [b+1]
            first row of each sequence in memory (None = cu_seqlens); `max_seqlen_q/k` ints.
        seqlens_q/k: dense int32 [b] valid lengths of a right-padded batch (None = full).
        softmax_scale: multiplies q . k.
        window_size: (left, right); query i sees key j iff i + off - left <= j <= i + off + right,
            -1 = unbounded; off = s_k - s_q of the sequence if `bottom_right` else 0.
        bias: dense only, additive [b, h_q, s_q, s_k] view (broadcast dims stride 0).
        alibi_slopes: fp32 [b, h_q] view; adds -slope * |i + off - j|.
        softcap: `softcap * tanh(s / softcap)` on the scaled scores when > 0.
        dropout_p, rng_state: drop probability and int64 CPU [2] (seed, offset); drawn from
            torch's default generator when None and dropout_p > 0. The backward regenerates the
            same keep-mask (`dropout_keep_mask`).
        deterministic: bitwise-reproducible gradients: the backward runs its two-pass scheme
            (no atomics). False allows the atomic-dQ scheme (dQ folded into the dK/dV kernel
            with fp32 atomics, no bias gradient) where `_flash_bwd.ATOMIC_DQ_DEVICES` enables
            it, which it does not by default: dk/dv stay reproducible, dq varies in its last
            bits.
        q_descale, k_descale, v_descale: used with float8_e4m3fn q, k, v (all three fp8;
            sm_89+ or the interpreter), ignored otherwise: fp32 [b, h_kv] (any strides) or None
            (1); the inputs' values are x * x_descale of their (sequence, KV head). Forward
            only: fp8 inputs that require grad raise a ValueError. The portable kernel runs
            them (`dispatch` declines fp8 for the sm_90 one).

    Returns:
        out: dense [b, s_q, h_q, d_v] / varlen [t_q, h_q, d_v], dtype of q (bf16 for fp8
            inputs); rows with no visible key are 0.
        lse: fp32 dense [b, h_q, s_q] / varlen [h_q, t_q], natural log; -inf on empty rows.
            Differentiable: a loss may read it (attention sinks scale out by sigmoid(lse - s)).
            With dropout it is the LSE of the scores before dropout, as the forward uses it.
            Rows with LSE -inf get zero gradients whatever their upstream gradient holds.
    """
    dtype = output_dtype(q.dtype)
    descale = None
    if q.dtype == FP8_DTYPE:
        descale = _fp8_descale(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q)
    if _compat.upcast_bf16(q.dtype):  # the interpreter's bf16 dot is wrong: compute in fp32
        q, k, v = q.float(), k.float(), v.float()
    if dropout_p > 0 and rng_state is None:
        # torch.randint on the default generator: reproducible under torch.manual_seed, and
        # traceable by torch.compile (the state is an op input, not a Python-side int).
        rng_state = torch.randint(0, _RNG_BOUND, (2,), dtype=torch.int64)
    # Named one by one: Dynamo (torch 2.11) cannot trace `locals()`.
    args = _arguments(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seq_offsets_q=seq_offsets_q, seq_offsets_k=seq_offsets_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
        softmax_scale=softmax_scale, window_size=window_size, bottom_right=bottom_right,
        bias=bias, alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
        rng_state=rng_state, deterministic=deterministic, descale=descale,
    )  # fmt: skip
    out, lse = pick_forward(flash_attn_fwd, _eager_apply, _forward_impl, (q, k, v, bias))(*args)
    return (out, lse) if out.dtype == dtype else (out.to(dtype), lse)


def _fp8_descale(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q) -> Tensor | None:
    """The forward op's one descale tensor, fp32 [b, h_kv, 3] (q, k, v: each program reads its
    three side by side), or None when no descale is given; raises when an input requires grad.

    Built on the device (a stack, no host read), so a captured graph replays it."""
    descales = (q_descale, k_descale, v_descale)
    tracked = [t for t in (q, k, v, *descales) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tracked):
        raise ValueError(
            "float8_e4m3fn attention is forward only: q, k, v and their descales must not "
            "require grad (detach them or run under torch.no_grad())"
        )
    if all(d is None for d in descales):
        return None
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    ones = torch.ones((), dtype=torch.float32, device=q.device).expand(batch, k.shape[-2])
    return torch.stack([ones if d is None else d for d in descales], dim=-1)


def _arguments(
    q, k, v, *, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q,
    max_seqlen_k, seqlens_q, seqlens_k, softmax_scale, window_size, bottom_right, bias,
    alibi_slopes, softcap, dropout_p, rng_state, deterministic, descale=None,
) -> tuple:  # fmt: skip
    """`_forward_impl`'s argument list from `flash_attention`'s arguments (the custom op's
    schema: plain floats, ints and bools; no rng_state without dropout)."""
    return (
        q, k, v, cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q,
        max_seqlen_k, seqlens_q, seqlens_k, float(softmax_scale), int(window_size[0]),
        int(window_size[1]), bool(bottom_right), bias, alibi_slopes, float(softcap),
        float(dropout_p), rng_state if dropout_p > 0 else None, bool(deterministic), descale,
    )  # fmt: skip


class PlannedCall(NamedTuple):
    """One dense `flash_attention` call without tensor arguments besides q, k and v (so no
    descales: fp8 calls are never planned), planned for every call on inputs of one signature
    (`plan_call`)."""

    arguments: tuple  # `_forward_impl`'s argument list after q, k and v
    launch: dict  # `flash_attention_forward`'s keywords after q, k and v (`_launch_keywords`)
    backward: dict  # the eager backward's keywords (`_backward_keywords`)


def plan_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    bottom_right: bool = True,
    softcap: float = 0.0,
    deterministic: bool = False,
) -> PlannedCall:
    """The host-side part of `flash_attention(q, k, v, ...)` that follows from the inputs'
    `_launch.tensor_signature`s and these arguments, for a caller that repeats the call
    (fusedlayers' front end keeps one per validated signature). No dropout: its seed and offset
    are drawn per call and specialize the launch. Not for fp8 inputs: their calls check for
    gradients per call (`_fp8_descale`), which a planned call skips."""
    if q.dtype == FP8_DTYPE:
        raise ValueError("plan_call does not plan float8_e4m3fn calls: use flash_attention")
    args = _arguments(
        q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seq_offsets_q=None, seq_offsets_k=None,
        max_seqlen_q=None, max_seqlen_k=None, seqlens_q=None, seqlens_k=None,
        softmax_scale=softmax_scale, window_size=window_size, bottom_right=bottom_right,
        bias=None, alibi_slopes=None, softcap=softcap, dropout_p=0.0, rng_state=None,
        deterministic=deterministic,
    )  # fmt: skip
    launch = _launch_keywords(**dict(zip(_FWD_ARGS, args)))
    scalars = dict(zip(_SCALAR_INPUTS, _SAVED_SCALARS(args)))
    return PlannedCall(args[3:], launch, _backward_keywords(scalars, launch, False))


def flash_attention_planned(q: Tensor, k: Tensor, v: Tensor, call: PlannedCall):
    """`flash_attention` on q, k and v for the call `plan_call` planned: the same (out, lse)
    and gradients. The caller guarantees that each input has the `tensor_signature` of the
    one the plan was made from (the launches trust the plan's signature; with
    `_launch.set_signature_checks(True)` every launch verifies it)."""
    args = (q, k, v, *call.arguments)
    route = pick_forward(flash_attn_fwd, _eager_apply, _planned_forward, (q, k, v))
    if route is flash_attn_fwd:  # traced: the plan is the eager routes' shortcut
        return route(*args)
    return route(*args, planned=call)


__all__ = [
    "PlannedCall",
    "flash_attention",
    "flash_attention_planned",
    "flash_attn_bwd",
    "flash_attn_fwd",
    "plan_call",
]
