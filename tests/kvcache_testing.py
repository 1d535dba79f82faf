"""Shared harness for the `flash_attn_with_kvcache` tests (CPU interpreter and GPU suites).

A `KVCase` describes one decoding call; `make_kv_inputs` builds fresh random inputs for it: a
logical cache [b, s_cache, hk, d] per sequence, poisoned with NaN wherever no key may be read
(rows past cache_seqlens, rows before cache_leftpad, cache entries no sequence uses, pages no
sequence uses), stored contiguously (optionally under a cache_batch_idx permutation) or paged
(shuffled pages, page_size rows each, block_table entries past a sequence's pages set to -1).

The oracle is independent of the kernels: the expected cache after the append is built row by
row in Python (rotary in fp64 from the half-width tables), and attention runs per sequence on the
gathered visible keys with `attention_reference` (fp64 = high; the input dtype = PyTorch's own
error, the pass rule of tests/attention_testing.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from attention_testing import check_close, lse_atol

from fusedlayers import flash_attn_with_kvcache
from fusedlayers.attention.reference import attention_reference


@dataclasses.dataclass(frozen=True)
class KVCase:
    b: int = 2
    s_q: int = 1
    s_new: int = 0
    h: int = 4
    hk: int = 2
    d: int = 16
    s_cache: int = 64
    dtype: torch.dtype = torch.float16
    page_size: int | None = None  # paged when set
    batch_idx: bool = False
    leftpad: bool = False
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    rotary: str | None = None  # None, "interleaved", "half" (GPT-NeoX)
    rotary_dim: int | None = None  # default d
    num_splits: int = 0
    seqlens: str = "random"  # "random" (first = the longest that fits), "zero", "full"
    seed: int = 0

    def label(self) -> str:
        base = KVCase()
        parts = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(base, f.name)
        ]
        return ",".join(parts).replace("torch.", "") or "default"


def _lengths(case: KVCase, g: torch.Generator) -> list[int]:
    top = case.s_cache - case.s_new
    if case.seqlens == "zero":
        return [0] * case.b
    if case.seqlens == "full":
        return [top] * case.b
    lens = torch.randint(0, top + 1, (case.b,), generator=g).tolist()
    lens[0] = top
    return lens


def make_kv_inputs(case: KVCase, device) -> dict:
    """Random inputs for `case` (see the module docstring); `logical` holds the cache per
    sequence [b, s_cache, hk, d] before the call, for building the expected result."""
    g = torch.Generator().manual_seed(case.seed)

    def randn(*shape):
        return torch.randn(shape, generator=g).to(case.dtype)

    b, hk, d, s_cache = case.b, case.hk, case.d, case.s_cache
    lens = _lengths(case, g)
    pads = [int(torch.randint(0, n + 1, (1,), generator=g)) if case.leftpad else 0 for n in lens]
    logical_k, logical_v = randn(b, s_cache, hk, d), randn(b, s_cache, hk, d)
    for z in range(b):  # poison every row no key may be read from
        for t in (logical_k, logical_v):
            t[z, lens[z] :] = float("nan")
            t[z, : pads[z]] = float("nan")
    inputs = dict(
        q=randn(b, case.s_q, case.h, d),
        k=randn(b, case.s_new, hk, d) if case.s_new else None,
        v=randn(b, case.s_new, hk, d) if case.s_new else None,
        cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32) if case.leftpad else None,
        cache_batch_idx=None,
        block_table=None,
        alibi_slopes=None,
        rotary_cos=None,
        rotary_sin=None,
    )
    if case.page_size is not None:
        ps = case.page_size
        assert s_cache % ps == 0
        max_blocks = s_cache // ps
        num_blocks = b * max_blocks + 3
        perm = torch.randperm(num_blocks, generator=g)[: b * max_blocks].view(b, max_blocks)
        k_cache = torch.full((num_blocks, ps, hk, d), float("nan")).to(case.dtype)
        v_cache = k_cache.clone()
        for z in range(b):
            for j in range(max_blocks):
                k_cache[perm[z, j]] = logical_k[z, j * ps : (j + 1) * ps]
                v_cache[perm[z, j]] = logical_v[z, j * ps : (j + 1) * ps]
        table = perm.clone()
        for z in range(b):  # pages past the sequence's end are never read: mark them invalid
            table[z, math.ceil((lens[z] + case.s_new) / ps) :] = -1
        inputs["block_table"] = table.to(torch.int32)
    elif case.batch_idx:
        entries = torch.randperm(b + 2, generator=g)[:b]
        k_cache = torch.full((b + 2, s_cache, hk, d), float("nan")).to(case.dtype)
        v_cache = k_cache.clone()
        k_cache[entries], v_cache[entries] = logical_k, logical_v
        inputs["cache_batch_idx"] = entries.to(torch.int32)
    else:
        k_cache, v_cache = logical_k.clone(), logical_v.clone()
    inputs.update(k_cache=k_cache, v_cache=v_cache)
    if case.alibi:
        geometric = 2.0 ** (-8.0 * torch.arange(1, case.h + 1) / case.h)
        inputs["alibi_slopes"] = (geometric * (0.5 + torch.rand(b, case.h, generator=g))).float()
    if case.rotary is not None:
        rot = case.rotary_dim or d
        angle = torch.rand(s_cache, rot // 2, generator=g, dtype=torch.float64) * 2 * math.pi
        inputs["rotary_cos"] = angle.cos().to(case.dtype)
        inputs["rotary_sin"] = angle.sin().to(case.dtype)
    moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return dict(moved, logical_k=logical_k, logical_v=logical_v, lens=lens, pads=pads)


# The two ways a split call merges its splits (kernels/_flash_decode.py, `FUSED_COMBINE`).
COMBINES = ("fused", "separate")


def pin_combine(monkeypatch, combine: str) -> list[str]:
    """Pin the split merge to `combine` for a test; returns the list that every later
    `_decode_combine` launch (the separate merge) appends its kernel name to."""
    from fusedlayers.kernels import _decode_merge, _flash_decode

    assert combine in COMBINES
    monkeypatch.setattr(_flash_decode, "FUSED_COMBINE", combine == "fused")
    merges: list[str] = []
    original = _flash_decode.launch

    def spy(kernel, *args, **kwargs):
        if kernel is _decode_merge._decode_combine:
            merges.append(kernel.fn.__name__)
        return original(kernel, *args, **kwargs)

    monkeypatch.setattr(_flash_decode, "launch", spy)
    return merges


def tickets_all_zero() -> bool:
    """Every ticket counter of the fused merge, on every device, current buffers and replaced
    ones alike, is back at 0 (true also when none was made)."""
    from fusedlayers.kernels import _decode_merge

    buffers = [*_decode_merge._TICKETS.values(), *_decode_merge._RETIRED_TICKETS]
    return not any(counters.any().item() for counters in buffers)


def call_kernel(case: KVCase, inputs: dict, **overrides):
    """flash_attn_with_kvcache on `inputs` (the caches are updated in place) -> (out, lse)."""
    args = {
        n: inputs[n]
        for n in ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin")
        + ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes")
    }
    args.update(
        causal=case.causal,
        window_size=case.window,
        softcap=case.softcap,
        rotary_interleaved=case.rotary != "half",
        num_splits=case.num_splits,
        return_softmax_lse=True,
    )
    args.update(overrides)
    return flash_attn_with_kvcache(**args)


def rotate_fp64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions, interleaved):
    """Rotary of x [s, h, d] at integer positions [s] from half-width tables, in fp64."""
    x = x.double()
    rot = 2 * cos.shape[1]
    c = cos.double()[positions][:, None, :]  # [s, 1, rot / 2]
    s = sin.double()[positions][:, None, :]
    if interleaved:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out, x[..., rot:]), dim=-1)


def expected_logical(case: KVCase, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical caches [b, s_cache, hk, d] after the append (fp64; rotary applied to new keys)."""
    k_exp, v_exp = inputs["logical_k"].double().clone(), inputs["logical_v"].double().clone()
    for z, start in enumerate(inputs["lens"]):
        rows = list(range(start, start + case.s_new))
        if not rows:
            continue
        k_new = inputs["k"][z].cpu()
        if case.rotary is not None:
            cos, sin = inputs["rotary_cos"].cpu(), inputs["rotary_sin"].cpu()
            k_new = rotate_fp64(k_new, cos, sin, rows, case.rotary == "interleaved")
        k_exp[z, rows] = k_new.double()
        v_exp[z, rows] = inputs["v"][z].cpu().double()
    return k_exp, v_exp


def read_logical(case: KVCase, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as logical [b, s_cache, hk, d] (CPU) through block_table / cache_batch_idx."""
    k_cache, v_cache = inputs["k_cache"].cpu(), inputs["v_cache"].cpu()
    if inputs["block_table"] is not None:
        ps, table = case.page_size, inputs["block_table"].cpu()
        out = []
        for cache in (k_cache, v_cache):
            rows = torch.full((case.b, case.s_cache, case.hk, case.d), float("nan"))
            for z in range(case.b):
                for j in range(case.s_cache // ps):
                    if table[z, j] >= 0:
                        rows[z, j * ps : (j + 1) * ps] = cache[table[z, j]].float()
            out.append(rows.to(case.dtype))
        return out[0], out[1]
    if inputs["cache_batch_idx"] is not None:
        idx = inputs["cache_batch_idx"].cpu().long()
        return k_cache[idx], v_cache[idx]
    return k_cache, v_cache


def check_cache(case: KVCase, inputs: dict, before: tuple[torch.Tensor, torch.Tensor]) -> None:
    """New rows equal the (rotated) new k/v, to one rounding of the input dtype; every other
    byte of both cache tensors is unchanged (NaN poison included)."""
    k_exp, v_exp = expected_logical(case, inputs)
    k_got, v_got = read_logical(case, inputs)
    eps = torch.finfo(case.dtype).eps
    for name, got, exp in (("k", k_got, k_exp), ("v", v_got, v_exp)):
        torch.testing.assert_close(
            got.double(), exp, rtol=eps, atol=eps, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}"
        )
    # Untouched memory: compare the raw caches with their new rows masked out.
    k_after, v_after = inputs["k_cache"].cpu(), inputs["v_cache"].cpu()
    written = torch.zeros(k_after.shape[:2], dtype=torch.bool)
    for z, start in enumerate(inputs["lens"]):
        for row in range(start, start + case.s_new):
            if inputs["block_table"] is not None:
                page = int(inputs["block_table"][z, row // case.page_size])
                written[page, row % case.page_size] = True
            elif inputs["cache_batch_idx"] is not None:
                written[int(inputs["cache_batch_idx"][z]), row] = True
            else:
                written[z, row] = True
    for name, after, old in (("k_cache", k_after, before[0]), ("v_cache", v_after, before[1])):
        torch.testing.assert_close(
            after[~written], old[~written], rtol=0, atol=0, equal_nan=True,
            msg=lambda m, n=name: f"{n} changed outside the appended rows: {m}",
        )  # fmt: skip


def _query_positions(case: KVCase, start: int) -> list[int]:
    if case.causal or case.window != (-1, -1):
        return [start + i for i in range(case.s_q)]
    return [start] * case.s_q


def reference(case: KVCase, inputs: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the cache the kernel left behind (checked separately by `check_cache`),
    per sequence on its visible keys [leftpad, len + s_new); fp64 = high, else PyTorch's error
    in the input dtype (queries rotated in fp32 and rounded to it, as the kernel path does)."""
    k_log, v_log = read_logical(case, inputs)
    q_all = inputs["q"].cpu()
    outs, lses = [], []
    window = (case.window[0], 0) if case.causal else case.window
    for z, (start, pad) in enumerate(zip(inputs["lens"], inputs["pads"])):
        q = q_all[z]
        if case.rotary is not None:
            cos, sin = inputs["rotary_cos"].cpu(), inputs["rotary_sin"].cpu()
            positions = _query_positions(case, start)
            q = rotate_fp64(q, cos, sin, positions, case.rotary == "interleaved")
            q = q if dtype == torch.float64 else q.float().to(case.dtype)
        end = start + case.s_new
        if end - pad == 0:  # no key at all: output 0, LSE -inf
            outs.append(torch.zeros(case.s_q, case.h, case.d, dtype=case.dtype))
            lses.append(torch.full((case.h, case.s_q), float("-inf")))
            continue
        slopes = inputs["alibi_slopes"]
        o, lse = attention_reference(
            q[None].to(dtype),
            k_log[z : z + 1, pad:end].to(dtype),
            v_log[z : z + 1, pad:end].to(dtype),
            window_size=window,
            bottom_right=True,
            softcap=case.softcap,
            alibi_slopes=None if slopes is None else slopes[z : z + 1].cpu(),
            return_lse=True,
        )
        outs.append(o[0].to(case.dtype if dtype != torch.float64 else dtype))
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def check_kv_case(case: KVCase, device, call=call_kernel) -> dict:
    """Run the call (`call(case, inputs)`, `call_kernel`'s form); check the cache contents and
    out/LSE against the fp64 oracle."""
    inputs = make_kv_inputs(case, device)
    before = (inputs["k_cache"].cpu().clone(), inputs["v_cache"].cpu().clone())
    out, lse = call(case, inputs)
    check_cache(case, inputs, before)
    high_out, high_lse = reference(case, inputs, torch.float64)
    low_out, low_lse = reference(case, inputs, case.dtype)
    s_k = case.s_cache
    return dict(
        out=check_close("out", out.cpu(), high_out, low_out, factor=2.0),
        lse=check_close(
            "lse", lse.cpu(), high_lse.float(), low_lse, factor=2.0, atol=lse_atol(high_lse, s_k)
        ),
    )
