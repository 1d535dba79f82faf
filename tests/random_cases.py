"""Seeded random differential cases for the attention kernels: the generator.

`draw_case(route, seed, index, limits)` draws one whole configuration from its own
`random.Random`, seeded by (seed, route, index): case `index` is the same case whatever the case
count, so one case reruns alone. `random_runner.run_route` runs a route's cases and checks each
against `attention_reference` in higher precision (fp64 on the CPU; on CUDA fp32, fp64 for fp32
inputs) by the pass rule of tests/attention_testing.py (`check_close`): the kernel's max error is
at most 2x (output, LSE) or 3x (gradients) the error of the same computation by PyTorch in the
input dtype, plus an atol of one unit. Decode cases use the oracle of tests/kvcache_testing.py.

What is drawn, and why (every draw is made valid by construction; a ValueError/TypeError from
an entry point's first call still counts as "rejected", not as a failure):
- entry points: `DotProductAttention` (sbhd/bshd/thd), `flash_attn_func`, `flash_attn_varlen_func`
  (also with a paged K/V `block_table`), the four packed variants; on the decode route
  `flash_attn_with_kvcache` (contiguous or paged cache, with or without appending k/v, rotary,
  leftpad, cache_batch_idx, num_splits) and `fusedlayers.kernels.decode_attention`. Every route
  of the front end that reaches a kernel, with the arguments users pass.
- layouts, since a layout is a claim about every stride (TE issue 1195): separate tensors, TE's
  packed buffers (`x3hd`, `xh3d`, `f_x2hd`, `f_xh2d`), heads split from one projection output
  `[tokens, h + 2*hg, d]`, and "strided" views (padded head dim at an aligned or odd offset,
  spare heads, head-major storage, the other format's token order). Memory no view covers is
  NaN-poisoned in half the cases, and its gradient must come back exactly 0.
- dtypes fp16/bf16/fp32 (bf16 on CUDA only: the interpreter's bf16 dot is wrong), head dims from
  `HEAD_DIMS` with d_v != d_qk where the entry takes it, GQA/MQA ratios 1, 2, 4 and h.
- lengths 1, 2 and ones that are no multiple of any block, s_q != s_kv, batch 1..3; right-padded
  batches (padding masks as one mask, a (q, kv) pair or cu_seqlens), varlen with empty
  sequences and with gaps between sequences (`cu_seqlens_*_padded`); padded rows and gaps are
  NaN-poisoned in half the cases (the kernels must not read them).
- every TE mask type, TE and flash-attn windows, ALiBi, softcap, TE's post-scale bias with and
  without its gradient (in the input dtype or fp32), a softmax scale, deterministic=True (whose
  gradients must then be bitwise reproducible).
- repeats: about a third of the cases call their configuration three times (grad, no grad and
  `.backward()` into `.grad`, in several orders) with one call of another configuration in
  between, on the same leaf tensors refilled in place with fresh values, and check every result:
  what catches a cache keyed by the call signature that keeps something it should not.
- routes (`pinned_route`): "portable", "sm90" (70% of its cases stay inside what the sm_90
  kernels cover: fp16/bf16, d = 64/128, no window, bias, ALiBi or softcap), "decode", "auto".
Not drawn: dropout (its keep-mask needs the kernels' RNG; tests/attention_testing.py covers it),
`pre_scale_bias`, padding masks that are not right-padded, `checkpoint_core_attention`, an int
`cache_seqlens`, rotary with cache_leftpad; bf16 and "sm90" on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable

import torch
from fusedlayers.kernels import set_backward_path, set_forward_path
from kvcache_testing import KVCase

ROUTES = ("portable", "sm90", "decode", "auto")
HEAD_DIMS = (32, 40, 59, 64, 72, 80, 96, 111, 128, 160, 192, 256)
MASK_TYPES = (
    "no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
    "padding_causal_bottom_right", "arbitrary",
)  # fmt: skip
DPA = "DotProductAttention"
PAGED = "flash_attn_varlen_func+block_table"
TRAINING_ENTRIES = {  # entry: weight
    DPA: 9, "flash_attn_func": 3, "flash_attn_varlen_func": 3, PAGED: 1,
    "flash_attn_qkvpacked_func": 1, "flash_attn_kvpacked_func": 1,
    "flash_attn_varlen_qkvpacked_func": 1, "flash_attn_varlen_kvpacked_func": 1,
}  # fmt: skip
DECODE_ENTRIES = ("flash_attn_with_kvcache", "flash_attn_with_kvcache", "decode_attention")
DPA_LAYOUTS = ("separate", "separate", "strided", "3hd", "h3d", "2hd", "h2d", "heads_split")
SHARED_TOKENS = ("3hd", "h3d", "heads_split")  # q, k and v read one buffer's tokens
SAME_DV = ("3hd", "h3d", "2hd", "h2d", "heads_split", "packed")
REPEATS = (  # three calls of one configuration; "other" is inserted between two of them
    ("grad", "no_grad", "grad"), ("no_grad", "grad", "backward"), ("backward", "grad", "no_grad"),
    ("grad", "backward", "backward"), ("no_grad", "no_grad", "grad"),
)  # fmt: skip
DECODE_REPEATS = (("grad", "no_grad", "grad"), ("no_grad", "grad", "no_grad"))
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@dataclasses.dataclass(frozen=True)
class Limits:
    """Sizes a device can afford: the interpreter runs one program at a time."""

    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...]
    lengths: tuple[int, ...]
    max_heads: int
    max_tokens: int  # b * max(s_q, s_kv)
    cache_sizes: tuple[int, ...]
    max_cache_tokens: int  # b * s_cache
    page_sizes: tuple[int, ...]  # decode pages: multiples of 16
    varlen_page_sizes: tuple[int, ...]
    max_batch: int = 3


CPU_LIMITS = Limits(
    dtypes=(F16, F32), head_dims=(32, 40, 59, 64), lengths=(1, 2, 5, 7, 16, 17, 31, 33),
    max_heads=4, max_tokens=66, cache_sizes=(16, 32), max_cache_tokens=64, page_sizes=(16,),
    varlen_page_sizes=(1, 3, 8, 16),
)  # fmt: skip
GPU_LIMITS = Limits(
    dtypes=(BF16, BF16, F16, F16, F32), head_dims=HEAD_DIMS,
    lengths=(1, 2, 7, 16, 17, 33, 63, 64, 65, 97, 128, 129, 191, 256, 257), max_heads=8,
    max_tokens=771, cache_sizes=(16, 48, 64, 128, 256, 512, 1024), max_cache_tokens=2048,
    page_sizes=(16, 32, 64, 128, 256), varlen_page_sizes=(1, 16, 64, 128),
)  # fmt: skip


def limits_for(device) -> Limits:
    return GPU_LIMITS if torch.device(device).type == "cuda" else CPU_LIMITS


@contextlib.contextmanager
def pinned_route(route: str):
    """Pin the attention kernel paths for one case and restore them after it: the one place that
    knows the path switches. "portable" and "sm90" pin forward and backward ("sm90" still falls
    back to the portable kernels for calls it does not cover and off sm_90 GPUs); "auto" and
    "decode" leave the choice to the measured dispatch."""
    path = route if route in ("portable", "sm90") else "auto"
    previous = set_forward_path(path), set_backward_path(path)
    try:
        yield
    finally:
        set_forward_path(previous[0])
        set_backward_path(previous[1])


def _fields_repr(obj) -> str:
    """`Name(field=value, ...)` of the fields that differ from their defaults: evaluable with
    torch, Case and KVCase in scope, and the full identity of the case."""
    parts = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            parts.append(f"{f.name}={value!r}" if not dataclasses.is_dataclass(value) else
                         f"{f.name}={_fields_repr(value)}")  # fmt: skip
    return f"{type(obj).__name__}({', '.join(parts)})"


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration and the calls made with it; `str()` is an evaluable constructor.

    Shapes: q [b, s_q, h, d], k [b, s_kv, h_kv, d], v [b, s_kv, h_kv, d_v] in `qkv_format`
    (thd: [tokens, heads, dim]; s_q/s_kv are then the max_seqlens). lens_q/lens_kv: valid lengths
    (varlen, or a right-padded batch; lens_q None = every query valid); gaps_q/gaps_kv: thd rows
    after each sequence. layout: "separate", "3hd", "h3d", "2hd", "h2d", "heads_split",
    "packed" (flash-attn's packed arguments), "paged", or "strided:<q>,<k>,<v>" (`_strided`).
    mask: a TE mask type (DotProductAttention) or "no_mask"/"causal" (flash-attn).
    padding_via: "mask", "mask_pair" or "cu_seqlens"; arbitrary/bias: broadcast patterns over
    [b, h, s_q, s_kv] ("1hss": [1, h, s_q, s_kv]). calls: modes "grad" (autograd.grad),
    "backward" (.backward() into .grad), "no_grad", and "other" (the `other` case's calls).
    kv: the decode route's `KVCase`. data_seed: the tensors' values (call i adds i).
    """

    route: str
    entry: str
    dtype: torch.dtype = F16
    qkv_format: str = "bshd"
    layout: str = "separate"
    b: int = 1
    s_q: int = 1
    s_kv: int = 1
    h: int = 1
    h_kv: int = 1
    d: int = 32
    d_v: int = 32
    lens_q: tuple[int, ...] | None = None
    lens_kv: tuple[int, ...] | None = None
    gaps_q: tuple[int, ...] | None = None
    gaps_kv: tuple[int, ...] | None = None
    mask: str = "no_mask"
    padding_via: str | None = None
    arbitrary: str | None = None
    window: tuple[int, int] | None = None
    softmax_scale: float | None = None
    softcap: float = 0.0
    alibi: str | None = None  # "h": slopes [h]; "bh": [b, h]
    bias: str | None = None
    bias_grad: bool = False
    bias_fp32: bool = False
    page_size: int = 0
    deterministic: bool = False
    return_lse: bool = False
    poison: bool = False
    kv: KVCase | None = None
    calls: tuple[str, ...] = ("grad",)
    other: Case | None = None
    data_seed: int = 0

    def __str__(self) -> str:
        return _fields_repr(self)

    __repr__ = __str__


# ----------------------------------------------------------------------------- drawing


def draw_case(route: str, seed: int, index: int, limits: Limits) -> Case:
    """Case `index` of `route` for `seed`, drawn from its own `random.Random`."""
    rng = random.Random(f"fusedlayers-random-differential/{seed}/{route}/{index}")
    case = _draw_one(rng, route, limits)
    if rng.random() < 0.3:  # three calls of this configuration, another one in between
        calls = list(rng.choice(DECODE_REPEATS if route == "decode" else REPEATS))
        calls.insert(rng.randint(1, 2), "other")
        other = _draw_one(rng, route, limits, case.entry if rng.random() < 0.5 else None)
        return dataclasses.replace(case, calls=tuple(calls), other=other)
    single = ("grad", "no_grad") if route == "decode" else ("grad",) * 8 + ("backward", "no_grad")
    return dataclasses.replace(case, calls=(rng.choice(single),))


def _draw_one(rng: random.Random, route: str, lim: Limits, entry: str | None = None) -> Case:
    if route == "decode":
        return _draw_decode(rng, lim, entry)
    return _draw_training(rng, route, lim, entry)


def _draw_heads(rng, lim: Limits, same: bool) -> tuple[int, int]:
    """(h, h_kv) for a GQA ratio of 1, 2, 4 or h (MQA)."""
    if same:
        h = rng.randint(1, lim.max_heads)
        return h, h
    ratio = rng.choice((1, 2, 4, 0))
    if ratio == 0:
        return rng.randint(1, lim.max_heads), 1
    h_kv = rng.randint(1, max(1, lim.max_heads // ratio))
    return ratio * h_kv, h_kv


def _draw_lens(rng, b: int, s: int, first_full: bool) -> tuple[int, ...]:
    """b lengths in [0, s]: mostly >= 1 (8% empty, never the first); the first is s when
    `first_full` (varlen: then max_seqlen is exact)."""
    lens = [rng.randint(1, s) if rng.random() > 0.08 else 0 for _ in range(b)]
    lens[0] = s if first_full else max(lens[0], 1)
    return tuple(lens)


def _strided_layout(rng, fmt: str) -> str:
    styles = ("pad1", "pad8", "heads", "hmajor") + (("swap",) if fmt != "thd" else ())
    return "strided:" + ",".join(rng.choice(styles) for _ in range(3))


def _draw_entry_layout(rng, entry: str | None) -> tuple[str, str, str]:
    entry = entry or rng.choices(list(TRAINING_ENTRIES), list(TRAINING_ENTRIES.values()))[0]
    if entry == DPA:
        fmt = rng.choice(("sbhd", "bshd", "thd"))
        layout = rng.choice(DPA_LAYOUTS)
    else:
        fmt = "thd" if "varlen" in entry else "bshd"
        if entry == PAGED:
            layout = "paged"
        elif entry.endswith("packed_func"):
            layout = "packed"
        else:
            layout = rng.choice(("separate", "strided"))
    if layout == "strided":
        layout = _strided_layout(rng, fmt)
    return entry, fmt, layout


def _draw_training(rng, route: str, lim: Limits, entry: str | None) -> Case:
    hopper = route == "sm90" and rng.random() < 0.7  # inside the sm_90 kernels' coverage
    entry, fmt, layout = _draw_entry_layout(rng, entry)
    qkv_packed = "qkvpacked" in entry
    shared = layout in SHARED_TOKENS or qkv_packed
    half = tuple(t for t in lim.dtypes if t != F32)
    dtype = rng.choice(half if hopper else lim.dtypes)
    d = rng.choice([x for x in (64, 128) if x in lim.head_dims] if hopper else lim.head_dims)
    d_v = d
    if not (layout in SAME_DV or hopper) and rng.random() < 0.3:
        d_v = rng.choice([x for x in lim.head_dims if x != d])
    h, h_kv = _draw_heads(rng, lim, same=layout in ("3hd", "h3d") or qkv_packed)
    b = rng.randint(1, lim.max_batch)
    s_q = rng.choice(lim.lengths)
    s_kv = s_q if shared or rng.random() < 0.35 else rng.choice(lim.lengths)
    while b > 1 and b * max(s_q, s_kv) > lim.max_tokens:
        b -= 1
    case = Case(route, entry, dtype, fmt, layout, b, s_q, s_kv, h, h_kv, d, d_v)
    if entry == DPA:
        case = _draw_dpa_options(rng, case, hopper)
    else:
        case = _draw_flash_options(rng, case, hopper)
    case = _draw_sequences(rng, case, shared, lim)
    uncovered = layout.startswith("strided") or layout == "paged" or case.gaps_q or case.lens_kv
    return dataclasses.replace(
        case,
        softmax_scale=round(rng.uniform(0.05, 0.5), 3) if rng.random() < 0.2 else None,
        deterministic=rng.random() < (0.1 if hopper else 0.2),
        poison=bool(uncovered) and rng.random() < 0.5,
        data_seed=rng.randrange(2**31),
    )


def _draw_dpa_options(rng, case: Case, hopper: bool) -> Case:
    """A TE mask type with its padding form, a window valid for the type (TE's rule), and a
    post-scale bias or ALiBi (bias: not with thd)."""
    types = [
        t for t in MASK_TYPES if not (t == "arbitrary" and (case.qkv_format == "thd" or hopper))
    ]
    mask = rng.choice(types)
    out = dict(mask=mask)
    if "padding" in mask and case.qkv_format != "thd":
        out["padding_via"] = rng.choice(("mask", "mask_pair", "cu_seqlens"))
    if mask == "arbitrary":
        out["arbitrary"] = rng.choice(("b1ss", "bhss", "11ss", "1hss"))
    if not hopper and rng.random() < 0.3:
        left = rng.randint(0, case.s_kv)
        out["window"] = (left, 0) if "causal" in mask else (left, rng.randint(0, case.s_kv))
    if not hopper and case.qkv_format != "thd" and rng.random() < 0.25:
        out.update(bias=rng.choice(("1hss", "b1ss", "bhss", "11ss")), bias_grad=rng.random() < 0.6)
        out["bias_fp32"] = case.dtype != F32 and rng.random() < 0.3
    elif not hopper and rng.random() < 0.2:
        out["alibi"] = rng.choice(("h", "bh"))
    return dataclasses.replace(case, **out)


def _draw_flash_options(rng, case: Case, hopper: bool) -> Case:
    """flash-attn's causal (bottom-right), a window with each side -1 or not, ALiBi, softcap."""
    out = dict(mask="causal" if rng.random() < 0.45 else "no_mask", return_lse=rng.random() < 0.5)
    if not hopper:
        if rng.random() < 0.3:
            side = lambda: -1 if rng.random() < 0.3 else rng.randint(0, max(case.s_q, case.s_kv))
            out["window"] = (side(), side())
        if rng.random() < 0.2:
            out["alibi"] = rng.choice(("h", "bh"))
        if rng.random() < 0.2:
            out["softcap"] = rng.choice((0.7, 2.5, 30.0))
    return dataclasses.replace(case, **out)


def _draw_sequences(rng, case: Case, shared: bool, lim: Limits) -> Case:
    """Valid lengths for varlen and padded batches, thd gaps, the page size of paged K/V."""
    varlen = case.qkv_format == "thd"
    padded = case.padding_via is not None
    if not (varlen or padded):
        return case
    b, s_q, s_kv = case.b, case.s_q, case.s_kv
    full = varlen and rng.random() < 0.7
    lens_q = _draw_lens(rng, b, s_q, full)
    one_mask = case.padding_via == "mask"  # one [b, 1, 1, s] mask pads q too when s_q == s_kv
    lens_kv = lens_q if shared or (one_mask and s_q == s_kv) else _draw_lens(rng, b, s_kv, full)
    out = dict(lens_q=None if one_mask and s_q != s_kv else lens_q, lens_kv=lens_kv)
    if varlen and case.entry == DPA and rng.random() < 0.35:
        out["gaps_q"] = tuple(rng.randint(0, 3) for _ in range(b))
        out["gaps_kv"] = out["gaps_q"] if shared else tuple(rng.randint(0, 3) for _ in range(b))
    if case.layout == "paged":
        out["page_size"] = rng.choice(lim.varlen_page_sizes)
    return dataclasses.replace(case, **out)


def _draw_decode(rng, lim: Limits, entry: str | None) -> Case:
    """A `KVCase`: cache size, paging, appends, rotary, leftpad, batch index, masks, splits."""
    entry = entry or rng.choice(DECODE_ENTRIES)
    dtype = rng.choice(lim.dtypes)
    d = rng.choice(lim.head_dims)
    h, hk = _draw_heads(rng, lim, same=False)
    b = rng.randint(1, lim.max_batch)
    s_cache = rng.choice(lim.cache_sizes)
    while b > 1 and b * s_cache > lim.max_cache_tokens:
        b -= 1
    pages = [p for p in lim.page_sizes if s_cache % p == 0]
    page_size = rng.choice(pages) if pages and rng.random() < 0.5 else None
    s_q = rng.choice((1, 1, 1, 2, 3, 4))
    s_new = 0
    if entry == "flash_attn_with_kvcache" and rng.random() < 0.6:
        s_new = min(s_cache, rng.choice((1, s_q, rng.randint(1, 5))))
    rotary = rng.choice(("interleaved", "half")) if s_new and rng.random() < 0.3 else None
    rotary_dim = None
    if rotary and rng.random() < 0.4:
        rotary_dim = 2 * rng.randint(1, d // 2)
    window = (-1, -1)
    if rng.random() < 0.3:
        window = (rng.randint(0, s_cache), rng.choice((-1, 0, rng.randint(0, 3))))
    kv = KVCase(
        b=b, s_q=s_q, s_new=s_new, h=h, hk=hk, d=d, s_cache=s_cache, dtype=dtype,
        page_size=page_size, batch_idx=page_size is None and rng.random() < 0.2,
        leftpad=rotary is None and rng.random() < 0.2, causal=rng.random() < 0.5, window=window,
        softcap=rng.choice((0.7, 2.5, 30.0)) if rng.random() < 0.15 else 0.0,
        alibi=rng.random() < 0.15, rotary=rotary, rotary_dim=rotary_dim,
        num_splits=rng.choice((0, 0, 1, 2, 3, 5)),
        seqlens=rng.choices(("random", "zero", "full"), (8, 1, 1))[0], seed=rng.randrange(2**31),
    )  # fmt: skip
    return Case("decode", entry, dtype, b=b, s_q=s_q, s_kv=s_cache, h=h, h_kv=hk, d=d, d_v=d, kv=kv)


# ----------------------------------------------------------------------------- tensors


def _tokens(case: Case, side: str) -> tuple[int, ...]:
    """The token dims of q (side "q") or k/v in the case's format (thd: rows incl. gaps)."""
    s = case.s_q if side == "q" else case.s_kv
    if case.qkv_format == "thd":
        lens, gaps = (case.lens_q, case.gaps_q) if side == "q" else (case.lens_kv, case.gaps_kv)
        return (sum(lens) + sum(gaps or ()),)
    return (s, case.b) if case.qkv_format == "sbhd" else (case.b, s)


def _strided(style: str, tokens: tuple[int, ...], n: int, dim: int):
    """(buffer shape, view of a buffer) of one tensor [*tokens, n, dim] with stride(-1) == 1."""
    if style == "pad1":  # head dim padded, the view one element in: an odd base address
        return (*tokens, n, dim + 3), lambda t: t[..., 1 : 1 + dim]
    if style == "pad8":
        return (*tokens, n, dim + 8), lambda t: t[..., 8 : 8 + dim]
    if style == "heads":  # spare heads on both sides
        return (*tokens, n + 2, dim), lambda t: t.narrow(-2, 1, n)
    if style == "hmajor":  # heads outermost in memory
        return (n, *tokens, dim), lambda t: t.movedim(0, -2)
    assert style == "swap"  # the other 4-D format's token order (bshd storage for sbhd)
    return (tokens[1], tokens[0], n, dim), lambda t: t.transpose(0, 1)


def _layout(case: Case) -> tuple[list[tuple[int, ...]], Callable]:
    """(leaf buffer shapes, views(buffers) -> (q, k, v) in the case's format)."""
    tq, tk = _tokens(case, "q"), _tokens(case, "kv")
    h, hk, d, dv = case.h, case.h_kv, case.d, case.d_v
    layout = case.layout
    if layout == "packed":
        layout = "3hd" if "qkvpacked" in case.entry else "2hd"
    if layout in ("separate", "paged"):
        return [(*tq, h, d), (*tk, hk, d), (*tk, hk, dv)], tuple
    if layout in ("3hd", "h3d"):
        dim = -3 if layout == "3hd" else -2
        shape = (*tq, 3, h, d) if layout == "3hd" else (*tq, h, 3, d)
        return [shape], lambda bufs: tuple(bufs[0].select(dim, i) for i in range(3))
    if layout in ("2hd", "h2d"):
        dim = -3 if layout == "2hd" else -2
        kv_shape = (*tk, 2, hk, d) if layout == "2hd" else (*tk, hk, 2, d)
        return [(*tq, h, d), kv_shape], lambda bufs: (
            bufs[0],
            bufs[1].select(dim, 0),
            bufs[1].select(dim, 1),
        )
    if layout == "heads_split":  # one projection output [tokens, h + 2*hg, d] (TE issue 1195)
        return [(*tq, h + 2 * hk, d)], lambda bufs: (
            bufs[0].narrow(-2, 0, h),
            bufs[0].narrow(-2, h, hk),
            bufs[0].narrow(-2, h + hk, hk),
        )
    styles = layout.split(":")[1].split(",")
    specs = [_strided(s, t, n, dim) for s, t, n, dim in zip(styles, (tq, tk, tk), (h, hk, hk),
                                                            (d, d, dv))]  # fmt: skip
    return [s for s, _ in specs], lambda bufs: tuple(f(t) for (_, f), t in zip(specs, bufs))


def _canon(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """A format's tensor as bshd (or thd) for the reference: sbhd is transposed."""
    return t.transpose(0, 1) if fmt == "sbhd" else t


def _cu(lens) -> list[int]:
    return [0, *[sum(lens[: i + 1]) for i in range(len(lens))]]


def _pattern_shape(pattern: str, case: Case) -> tuple[int, ...]:
    full = (case.b, case.h, case.s_q, case.s_kv)
    return tuple(1 if c == "1" else n for c, n in zip(pattern, full))
