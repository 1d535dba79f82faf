"""The attention benchmark's cases and providers: what is built, checked and timed per shape.

A `Case` is one shape; its setup (`SETUPS[case.kind]`) returns a factory per provider and the
SDPA reference it is checked against. Every factory builds its own leaves from the same random
numbers, so every provider computes the same job on private autograd state. Used by
`fusedlayers.bench.attention` and by the profiling scripts in examples/perf/.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .common import (
    SDPA_REFUSALS,
    Reference,
    Runner,
    Unsupported,
    attention_work,
    short_error,
    total_work,
)
from .tables import dims_text

DEVICE = "cuda"  # the CPU tests point this at "cpu" to run the pipeline on tiny shapes
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
}


@dataclass
class Case:
    """One shape: what is built and checked once, then timed for every pass.

    q and k have head dim `d` (d_qk), v, dout and the output `d_v` (d unless given).
    """

    kind: str
    dtype: str
    d: int
    b: int
    hq: int
    hkv: int
    s: int  # max length for varlen
    causal: bool
    window: tuple[int, int] | None = None
    lengths: list[int] | None = None  # varlen only
    d_v: int | None = None

    def __post_init__(self) -> None:
        if self.d_v is None:
            self.d_v = self.d

    @property
    def dims(self) -> str:
        """`128`, or `192/128` for d_qk 192 with d_v 128."""
        return dims_text(self.d, self.d_v)

    @property
    def label(self) -> str:
        shape = f"d={self.dims} s={self.s} b={self.b} h={self.hq}"
        if self.hkv != self.hq:
            shape += f" hkv={self.hkv}"
        if self.lengths:
            shape = f"d={self.dims} tokens={sum(self.lengths)} seqs={len(self.lengths)} h={self.hq}"
        extra = f" window={self.window}" if self.window else f" causal={int(self.causal)}"
        return f"{self.kind} {self.dtype} {shape}{extra}"


@dataclass
class Setup:
    factories: dict[str, Callable[[], Runner]]
    refs: dict[str, Callable[[bool], Reference]]
    subject: str
    mem_baseline: str
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- inputs


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous copy that takes gradients: providers never share autograd state."""
    return t.detach().contiguous().clone().requires_grad_(True)


def _random_bhsd(case: Case) -> tuple[torch.Tensor, ...]:
    """q [b, hq, s, d], k [b, hkv, s, d], v [b, hkv, s, d_v], dout [b, hq, s, d_v]: random,
    never zeros (zeros hide unwritten outputs)."""
    dtype = DTYPES[case.dtype]
    b, s, d, d_v = case.b, case.s, case.d, case.d_v
    shapes = ((b, case.hq, s, d), (b, case.hkv, s, d), (b, case.hkv, s, d_v), (b, case.hq, s, d_v))
    return tuple(torch.randn(shape, device=DEVICE, dtype=dtype) for shape in shapes)


def _canon_same(out, grads):
    return out, grads


def _canon_bshd(out, grads):
    return out.transpose(1, 2), None if grads is None else [g.transpose(1, 2) for g in grads]


def _canon_repeated(groups: int, out, grads):
    """Grads of k/v repeated outside autograd, summed back over each KV head's query group."""
    if grads is None:
        return out, None
    dq, dk, dv = grads
    b, h, s, _ = dk.shape  # dk and dv may differ in head dim (d_qk, d_v)
    return out, [dq] + [g.view(b, h // groups, groups, s, g.shape[-1]).sum(2) for g in (dk, dv)]


def _canon_padded(valid: torch.Tensor, out, grads):
    """Padded [n, h, L, d] -> the valid tokens as thd [t, h, d]."""
    pick = lambda x: x.transpose(1, 2)[valid]
    return pick(out), None if grads is None else [pick(g) for g in grads]


def _canon_sbhd(h: int, packed: bool, out, grads):
    """Module output [s, b, h*d] and sbhd (or one sb3hd) grads -> bhsd."""
    out = out.unflatten(-1, (h, -1)).permute(1, 2, 0, 3)
    if grads is not None and packed:
        grads = [grads[0][:, :, i] for i in range(3)]
    return out, None if grads is None else [g.permute(1, 2, 0, 3) for g in grads]


# ----------------------------------------------------------------------------- providers
# Every factory takes `data` = (q, k, v, dout) in the case's reference layout and builds its own
# leaves from it, so every provider computes on the same numbers.


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _fused_dense_api(causal: bool, window: tuple[int, int] | None) -> tuple[Callable, str]:
    """flash_attn_func when fusedlayers has it, else the kernel entry with the same semantics."""
    import fusedlayers

    if hasattr(fusedlayers, "flash_attn_func"):
        ws, fn = window or (-1, -1), fusedlayers.flash_attn_func
        call = lambda q, k, v: _first(fn(q, k, v, causal=causal, window_size=ws))
        return call, "fusedlayers.flash_attn_func"
    from fusedlayers.kernels import flash_attention

    ws = window or ((-1, 0) if causal else (-1, -1))
    call = lambda q, k, v: flash_attention(
        q, k, v, softmax_scale=q.shape[-1] ** -0.5, window_size=ws, bottom_right=True
    )[0]
    return call, "fusedlayers.kernels.flash_attention (no flash_attn_func yet)"


def _pinned(path: str, call: Callable) -> Callable:
    """`call` with the forward kernel pinned to `path` ("portable" / "sm90") while it runs."""
    from fusedlayers.kernels import set_forward_path

    def pinned(*args):
        previous = set_forward_path(path)
        try:
            return call(*args)
        finally:
            set_forward_path(previous)

    return pinned


def _fused_dense_runner(name, data, flops, causal, window, ref="main") -> Runner:
    """fusedlayers on flash-attn's [b, s, h, d] layout (data is [b, h, s, d])."""
    call, api = _fused_dense_api(causal, window)
    if name == "fusedlayers-portable":
        call, api = _pinned("portable", call), f"{api}, portable forward kernel"
    leaves = [_leaf(t.transpose(1, 2)) for t in data[:3]]
    dout = data[3].transpose(1, 2).contiguous()
    note = f"{name}: {api}"
    return Runner(name, lambda: call(*leaves), leaves, dout, flops, _canon_bshd, ref, note)


def _fused_varlen_runner(data, cu, max_len, causal, flops) -> Runner:
    import fusedlayers

    leaves = [_leaf(t) for t in data[:3]]
    if hasattr(fusedlayers, "flash_attn_varlen_func"):
        api, fn = "fusedlayers.flash_attn_varlen_func", fusedlayers.flash_attn_varlen_func
        call = lambda: _first(fn(*leaves, cu, cu, max_len, max_len, causal=causal))
    else:
        from fusedlayers.kernels import flash_attention

        api = "fusedlayers.kernels.flash_attention (no flash_attn_varlen_func yet)"
        window = (-1, 0) if causal else (-1, -1)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len)
        scale = data[0].shape[-1] ** -0.5
        call = lambda: flash_attention(*leaves, **kw, softmax_scale=scale, window_size=window)[0]
    return Runner("fusedlayers", call, leaves, data[3], flops, _canon_same, note=f"varlen: {api}")


def _packed_views(buf: torch.Tensor, views: str) -> tuple[Callable, str]:
    """q/k/v views of an sb3hd buffer: `split` through fusedlayers.split_packed (what a fused
    QKV projection in MultiheadAttention does: the gradient comes back as one buffer, no copy),
    or `select` (`buf[:, :, i]`: autograd's select backward copies each gradient into a
    zero-filled buffer and sums them)."""
    import fusedlayers

    if views == "select":
        return lambda: [buf[:, :, i] for i in range(3)], "buf[:, :, i] selects"
    if hasattr(fusedlayers, "split_packed"):
        return lambda: fusedlayers.split_packed(buf, 2), "fusedlayers.split_packed(buf, 2)"
    return lambda: buf.unbind(2), "buf.unbind(2) (no split_packed yet)"


def _dpa_runner(name, data, flops, case: Case, views: str | None) -> Runner:
    """DotProductAttention on sbhd: separate contiguous q/k/v (`views` None) or views of one
    [s, b, 3, h, d] buffer (`views` "split" or "select", see `_packed_views`)."""
    import fusedlayers

    mask = "causal" if case.causal else "no_mask"
    call = fusedlayers.DotProductAttention(
        num_attention_heads=case.hq, kv_channels=case.d, qkv_format="sbhd", attn_mask_type=mask
    ).to(DEVICE)
    sbhd = [t.permute(2, 0, 1, 3) for t in data[:3]]
    dout = data[3].permute(2, 0, 1, 3).flatten(-2).contiguous()
    note = ""
    if views is not None:
        # One [s, b, 3, h, d] buffer, as a fused QKV projection writes it; q/k/v are its views.
        buf = _leaf(torch.stack(sbhd, dim=2))
        split, how = _packed_views(buf, views)
        leaves, forward, note = [buf], lambda: call(*split()), f"{name}: {how}"
    else:
        leaves = [_leaf(t) for t in sbhd]
        forward = lambda: call(*leaves)
    canon = functools.partial(_canon_sbhd, case.hq, views is not None)
    return Runner(name, forward, leaves, dout, flops, canon, note=note)


def _sdpa_call(backend: str, leaves, causal, mask, gqa) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kwargs = {"enable_gqa": True} if gqa else {}
    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal, **kwargs)


def _sdpa_refusal(forward: Callable[[], torch.Tensor]) -> str | None:
    """Why SDPA's pinned backend has no kernel for `forward`'s call (its warnings say, e.g. flash
    on d_v != d_qk), or None when the call runs. Any other error is raised, as from a call."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            forward()
        except RuntimeError as error:
            if not any(refusal in str(error) for refusal in SDPA_REFUSALS):
                raise
            # The reasons follow a "... not used because:" line; drop where it was triggered.
            reasons = [str(w.message).split(" (Triggered internally")[0] for w in caught]
            reasons = [r.strip() for r in reasons if r.strip() and not r.rstrip().endswith(":")]
            return reasons[0] if reasons else short_error(error)
    return None


def _sdpa_runner(name, backend, data, flops, causal, mask=None, canon=_canon_same) -> Runner:
    """SDPA on one backend; GQA through enable_gqa, or k/v repeated outside timing if refused.
    Raises Unsupported when the backend has no kernel for the call (a head dim, d_v != d_qk)."""
    q, k, v, dout = data
    groups = q.shape[1] // k.shape[1]
    leaves = [_leaf(t) for t in (q, k, v)]
    forward = lambda: _sdpa_call(backend, leaves, causal, mask, groups > 1)
    note = ""
    if groups > 1:
        try:
            with torch.no_grad():
                forward()
        except RuntimeError:
            leaves = [leaves[0]] + [_leaf(t.repeat_interleave(groups, dim=1)) for t in (k, v)]
            forward = lambda: _sdpa_call(backend, leaves, causal, mask, False)
            canon = functools.partial(_canon_repeated, groups)
            note = f"{name}: enable_gqa refused, k/v repeat_interleave'd outside timing"
    reason = _sdpa_refusal(forward)
    if reason is not None:
        raise Unsupported(reason)
    return Runner(name, forward, leaves, dout.contiguous(), flops, canon, note=note)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window_mod(left: int):
    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= left)

    return mod


def _flex_runner(data, flops, mask_mod) -> Runner:
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v, dout = data
    s_q, s_k, block_mask = q.shape[2], k.shape[2], None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, s_q, s_k, device=q.device)
    fn, gqa = _compiled_flex(), q.shape[1] != k.shape[1]
    leaves = [_leaf(t) for t in (q, k, v)]
    forward = lambda: fn(*leaves, block_mask=block_mask, enable_gqa=gqa)
    return Runner("flex", forward, leaves, dout.contiguous(), flops, _canon_same)


# ----------------------------------------------------------------------------- references

# MATH last: slow and memory-hungry at 16k, but it takes what the fused backends refuse
# (SDPA-flash refuses d_v != d_qk).
REF_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
MASK_REF_BACKENDS = ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")  # SDPA-flash takes no mask
BACKEND_NAMES = {backend: name for name, backend in SDPA_BACKENDS.items()} | {"MATH": "sdpa-math"}


def _sdpa_reference(data, need_grads, causal=False, mask=None, backends=REF_BACKENDS) -> Reference:
    """SDPA output (and grads) on the first backend that runs; GQA by repeating k/v in autograd."""
    q, k, v, dout = data
    groups, errors = q.shape[1] // k.shape[1], []
    for backend in backends:
        leaves = [_leaf(t) for t in (q, k, v)]
        kv = [t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in leaves[1:]]
        try:
            out = _sdpa_call(backend, [leaves[0], *kv], causal, mask, False)
            if need_grads:
                out.backward(dout)
        except RuntimeError as error:
            errors.append(f"{backend}: {short_error(error)}")
            continue
        grads = [t.grad for t in leaves] if need_grads else None
        return Reference(out.detach(), grads, BACKEND_NAMES.get(backend, backend))
    raise RuntimeError("no SDPA backend computed the reference: " + "; ".join(errors))


def _varlen_reference(data, need_grads, bounds, causal) -> Reference:
    """SDPA on each sequence of the thd batch separately, concatenated back to thd."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [_leaf(t) for t in data[:3]]
    outs = []
    with sdpa_kernel([getattr(SDPBackend, b) for b in REF_BACKENDS]):
        for a, b in zip(bounds, bounds[1:]):
            q, k, v = (t[a:b].transpose(0, 1)[None] for t in leaves)
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal)[0])
        out = torch.cat([o.transpose(0, 1) for o in outs])
        if need_grads:
            out.backward(data[3])
    grads = [t.grad for t in leaves] if need_grads else None
    return Reference(out.detach(), grads, "SDPA per sequence")


# ----------------------------------------------------------------------------- cases
P = functools.partial  # factories are built now and called one at a time, when measured


def _dense_setup(case: Case, want: Callable[[str], bool]) -> Setup:
    """sweep, gqa and window: one dense [b, h, s, d] problem for every provider."""
    data = _random_bhsd(case)
    shape = (case.b, case.hq, case.s, case.s, case.d)
    flops = attention_work(*shape, d_v=case.d_v, causal=case.causal, window=case.window)
    f: dict[str, Callable[[], Runner]] = {}
    for name in ("fusedlayers", "fusedlayers-portable"):
        if want(name):
            f[name] = P(_fused_dense_runner, name, data, flops, case.causal, case.window)
    if case.window is None:
        f |= {
            n: P(_sdpa_runner, n, be, data, flops, case.causal)
            for n, be in SDPA_BACKENDS.items()
            if want(n)
        }
        ref = P(_sdpa_reference, data, causal=case.causal)
        mod, baseline, notes = _causal_mod if case.causal else None, "sdpa-flash", []
    else:
        i = torch.arange(case.s, device=DEVICE)
        visible = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= case.window[0])
        ref = P(_sdpa_reference, data, mask=visible, backends=MASK_REF_BACKENDS)
        mod, baseline = _window_mod(case.window[0]), "flex"
        notes = ["SDPA has no sliding window: the check uses SDPA with an explicit mask"]
    if want("flex"):
        f["flex"] = P(_flex_runner, data, flops, mod)
    return Setup(f, {"main": ref}, "fusedlayers", baseline, notes)


def _padded(data, lengths: list[int]):
    """thd data -> padded [n, h, L, d] (random padding, dout 0 there) and the valid-token mask."""
    t, h, d = data[0].shape
    n, top = len(lengths), max(lengths)
    valid = torch.arange(top, device=DEVICE)[None] < torch.tensor(lengths, device=DEVICE)[:, None]
    out = []
    for i, x in enumerate(data):
        y = (torch.zeros if i == 3 else torch.randn)(n, top, h, d, device=DEVICE, dtype=x.dtype)
        y[valid] = x
        out.append(y.transpose(1, 2))
    return out, valid


def _varlen_setup(case: Case, want: Callable[[str], bool]) -> Setup:
    """thd with random lengths vs the dense kernel on the same tokens and SDPA on the padding."""
    lengths, h, d, causal = case.lengths, case.hq, case.d, case.causal
    t, n, top = sum(lengths), len(lengths), max(lengths)
    data = [torch.randn(t, h, d, device=DEVICE, dtype=DTYPES[case.dtype]) for _ in range(4)]
    bounds = [0, *itertools.accumulate(lengths)]
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    useful = total_work(attention_work(1, h, x, x, d, causal=causal) for x in lengths)
    refs = {"main": P(_varlen_reference, data, bounds=bounds, causal=causal)}
    f: dict[str, Callable[[], Runner]] = {}
    if want("fusedlayers"):
        f["fusedlayers"] = P(_fused_varlen_runner, data, cu, top, causal, useful)
        dense = [x.transpose(0, 1)[None] for x in data]  # all tokens as one sequence
        dense_flops = attention_work(1, h, t, t, d, causal=causal)
        f["fusedlayers-dense"] = P(
            _fused_dense_runner, "fusedlayers-dense", dense, dense_flops, causal, None, "dense"
        )
        refs["dense"] = P(_sdpa_reference, dense, causal=causal)
        # The same tokens as n equal sequences: the dense shape closest to the varlen batch.
        s_eq = t // n
        equal = [x[: n * s_eq].reshape(n, s_eq, h, d).transpose(1, 2) for x in data]
        f["fusedlayers-dense-equal"] = P(
            _fused_dense_runner, "fusedlayers-dense-equal", equal,
            attention_work(n, h, s_eq, s_eq, d, causal=causal), causal, None, "dense-equal",
        )  # fmt: skip
        refs["dense-equal"] = P(_sdpa_reference, equal, causal=causal)
    padded, valid = _padded(data, lengths)
    # Causal with right padding is exact without a mask (valid queries see only valid keys and
    # padded rows get dout 0); without causal, padded keys are masked where the backend can.
    mask = None if causal else valid[:, None, None, :]
    pad_flops = attention_work(n, h, top, top, d, causal=causal)
    canon = P(_canon_padded, valid)
    f |= {
        f"{n}-padded": P(_sdpa_runner, f"{n}-padded", be, padded, pad_flops, causal, mask, canon)
        for n, be in SDPA_BACKENDS.items()
        if want(n)
    }
    notes = [
        "*-padded: SDPA on the padded batch [seqs, h, max_len, d]; TFLOP/s count the padding; "
        "non-causal rows pass a key-padding mask, which SDPA-flash does not take",
        "fusedlayers-dense: all tokens as one sequence (more work; TFLOP/s count its own)",
        f"fusedlayers-dense-equal: the first {n} x (tokens // {n}) tokens as {n} sequences of "
        "equal length (a dense batch with the varlen batch's token and sequence counts; "
        "TFLOP/s count its own work)",
    ]
    return Setup(f, refs, "fusedlayers", "sdpa-flash-padded", notes)


def _packed_setup(case: Case, want: Callable[[str], bool]) -> Setup:
    data = _random_bhsd(case)
    flops = attention_work(case.b, case.hq, case.s, case.s, case.d, causal=case.causal)
    f: dict[str, Callable[[], Runner]] = {}
    if want("fusedlayers"):
        for name, views in (("sb3hd", "split"), ("sb3hd-select", "select"), ("sbhd", None)):
            name = f"fusedlayers-{name}"
            f[name] = P(_dpa_runner, name, data, flops, case, views)
    if want("sdpa-flash"):
        f["sdpa-flash"] = P(_sdpa_runner, "sdpa-flash", "FLASH_ATTENTION", data, flops, case.causal)
    ref = P(_sdpa_reference, data, causal=case.causal)
    notes = [
        "fusedlayers-sb3hd: q/k/v = fusedlayers.split_packed(buf, 2) of one [s, b, 3, h, d] "
        "buffer, as MultiheadAttention's fused QKV projection splits it: the kernels write the "
        "gradients into one buffer laid out like buf and it comes back uncopied; "
        "fusedlayers-sb3hd-select: plain buf[:, :, i] views, whose gradient autograd's select "
        "backward copies (a zero-filled buffer per view, then the sum); "
        "fusedlayers-sbhd: the same module on contiguous q/k/v"
    ]
    return Setup(f, {"main": ref}, "fusedlayers-sb3hd", "sdpa-flash", notes)


SETUPS = {
    "sweep": _dense_setup,
    "gqa": _dense_setup,
    "window": _dense_setup,
    "varlen": _varlen_setup,
    "packed": _packed_setup,
}
