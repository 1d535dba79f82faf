"""Repeated calls at one signature, with and without grad, in both orders and interleaved with a
second signature (`repeat_testing.SEQUENCES`), for every entry that keeps state per signature:
the front end's validated calls and planned kernel calls (`flash_attn_func`, `DotProductAttention`),
the launch plans of the forward and backward (dense and varlen), and the KV-cache checks and decode
plans (`flash_attn_with_kvcache`, including an in-place edit of `cache_seqlens` between calls).
Each call's output and gradients pass the 2x rule against the fp64 reference (fp32 on a GPU).

Runs on the CPU under the Triton interpreter and, through tests/gpu/test_repeat_calls_gpu.py, on a
GPU. The context-parallel ring's repeats are in test_context_parallel.py (two CPU processes) and
tests/gpu/test_context_parallel_gpu.py (two GPUs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_testing import check_close
from kvcache_testing import KVCase, call_kernel, make_kv_inputs, reference
from repeat_testing import SEQUENCES, grads_of, run_sequence

import fusedlayers
from fusedlayers import attention_reference

GRAD_NAMES = ("dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Signature:
    b: int
    s_q: int
    s_k: int
    h: int
    h_kv: int
    d: int
    causal: bool
    window: tuple[int, int] = (-1, -1)
    seed: int = 0


SIGNATURES = {
    "A": Signature(2, 9, 13, 4, 2, 16, causal=True),
    "B": Signature(1, 7, 7, 2, 1, 32, causal=False, window=(3, 1), seed=1),
}


def _dense(sig: Signature, device, dtype, qkv_format: str):
    """Leaves q, k, v and dout in `qkv_format` (bshd or sbhd), fresh normals."""
    g = torch.Generator().manual_seed(sig.seed)

    def rand(s, h):
        t = torch.randn(sig.b, s, h, sig.d, generator=g, dtype=torch.float64)
        return (t.transpose(0, 1) if qkv_format == "sbhd" else t).to(device, dtype)

    q, k, v = rand(sig.s_q, sig.h), rand(sig.s_k, sig.h_kv), rand(sig.s_k, sig.h_kv)
    return [t.requires_grad_() for t in (q, k, v)], rand(sig.s_q, sig.h)


def _varlen(sig: Signature, device, dtype):
    """thd leaves with sequences of lengths s_q - z (queries) and s_k - z (keys)."""
    g = torch.Generator().manual_seed(sig.seed)
    lens_q = [sig.s_q - z for z in range(sig.b)]
    lens_k = [sig.s_k - z for z in range(sig.b)]

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def rand(t, h):
        return torch.randn(t, h, sig.d, generator=g, dtype=torch.float64).to(device, dtype)

    q, k, v = rand(sum(lens_q), sig.h), rand(sum(lens_k), sig.h_kv), rand(sum(lens_k), sig.h_kv)
    meta = dict(cu_seqlens_q=cu(lens_q).to(device), cu_seqlens_k=cu(lens_k).to(device))
    meta.update(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return [t.requires_grad_() for t in (q, k, v)], rand(sum(lens_q), sig.h), meta


def _reference(q, k, v, dout, dtype, *, qkv_format, window, bottom_right, meta=None):
    """out and grads of the oracle (`attention_reference`, no front end: its cache is what is
    under test) on the inputs cast to `dtype`."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    meta = meta or {}
    views = [t.transpose(0, 1) if qkv_format == "sbhd" else t for t in leaves]
    out = attention_reference(
        *views, cu_seqlens_q=meta.get("cu_seqlens_q"), cu_seqlens_kv=meta.get("cu_seqlens_k"),
        window_size=window, bottom_right=bottom_right,
    )  # fmt: skip
    out = out.transpose(0, 1) if qkv_format == "sbhd" else out
    return out.detach(), torch.autograd.grad(out, leaves, dout.to(dtype))


class _Path:
    """One entry's calls on fixed leaves per signature, with their expected results."""

    def __init__(self, device, dtype):
        self.device, self.dtype = device, dtype
        self.high = torch.float64 if torch.device(device).type == "cpu" else torch.float32
        self.inputs, self.expected = {}, {}

    def check(self, signature, mode, i, result):
        out, grads = result
        high, low = self.expected[signature]
        where = f"call {i} ({signature}, {mode})"
        check_close(f"{where} out", out.detach().cpu(), high[0].cpu(), low[0].cpu(), factor=2.0)
        if grads is None:
            return
        for name, got, h, lo in zip(GRAD_NAMES, grads, high[1], low[1]):
            check_close(f"{where} {name}", got.cpu(), h.cpu(), lo.cpu(), factor=2.0)


class _FlashAttnFunc(_Path):
    """`flash_attn_func` (or `flash_attn_varlen_func`): bottom-right causal and windows."""

    def __init__(self, device, dtype, signatures, varlen: bool):
        super().__init__(device, dtype)
        self.varlen = varlen
        for name, sig in signatures.items():
            if varlen:
                leaves, dout, meta = _varlen(sig, device, dtype)
            else:
                (leaves, dout), meta = _dense(sig, device, dtype, "bshd"), {}
            window = (sig.window[0], 0) if sig.causal else sig.window
            fmt = "thd" if varlen else "bshd"
            self.inputs[name] = (leaves, dout, meta, sig)
            self.expected[name] = tuple(
                _reference(
                    *leaves, dout, t, qkv_format=fmt, window=window, bottom_right=True, meta=meta
                )
                for t in (self.high, dtype)
            )

    def run(self, signature, mode):
        leaves, dout, meta, sig = self.inputs[signature]
        options = dict(causal=sig.causal, window_size=sig.window)
        if self.varlen:
            out = fusedlayers.flash_attn_varlen_func(*leaves, **meta, **options)
        else:
            out = fusedlayers.flash_attn_func(*leaves, **options)
        return out, grads_of(out, tuple(leaves), dout, mode)


class _DotProductAttention(_Path):
    """TE's module, sbhd, top-left `causal` and windows through `window_size`."""

    def __init__(self, device, dtype, signatures):
        super().__init__(device, dtype)
        self.modules = {}
        for name, sig in signatures.items():
            leaves, dout = _dense(sig, device, dtype, "sbhd")
            mask = "causal" if sig.causal else "no_mask"
            window = (sig.window[0], 0) if sig.causal else sig.window
            self.modules[name] = fusedlayers.DotProductAttention(
                sig.h, sig.d, num_gqa_groups=sig.h_kv, qkv_format="sbhd", attn_mask_type=mask,
                window_size=window,
            )  # fmt: skip
            self.inputs[name] = (leaves, dout)
            self.expected[name] = tuple(
                _reference(*leaves, dout, t, qkv_format="sbhd", window=window, bottom_right=False)
                for t in (self.high, dtype)
            )

    def run(self, signature, mode):
        leaves, dout = self.inputs[signature]
        out = self.modules[signature](*leaves)
        out = out.view(*out.shape[:-1], leaves[0].shape[-2], leaves[0].shape[-1])
        return out, grads_of(out, tuple(leaves), dout, mode)


@pytest.fixture
def on_kernels(device, kernels_on_cpu):
    """The modules take the kernels on CPU tensors too (under the interpreter)."""
    return device


PATHS = {
    "flash_attn_func": lambda *args: _FlashAttnFunc(*args, varlen=False),
    "flash_attn_varlen_func": lambda *args: _FlashAttnFunc(*args, varlen=True),
    "DotProductAttention": _DotProductAttention,
}


def check_repeats(path: str, order: str, device, dtype, signatures=SIGNATURES) -> None:
    entry = PATHS[path](device, dtype, signatures)
    assert run_sequence(entry.run, entry.check, order) >= 6


@pytest.mark.parametrize("order", SEQUENCES)
@pytest.mark.parametrize("path", PATHS)
def test_repeated_calls(path, order, on_kernels):
    check_repeats(path, order, on_kernels, torch.float16)


KV_SIGNATURES = {
    "A": KVCase(b=2, s_q=1, s_new=1, h=4, hk=2, d=16, s_cache=32, page_size=16, seed=3),
    "B": KVCase(b=1, s_q=2, h=2, hk=1, d=32, s_cache=48, causal=True, seed=4),
}
KV_ORDERS = {
    "repeat": ["A", "A", "A", "B", "A", "B", "A"],
    "interleaved": ["B", "A", "B", "A", "A", "B"],
}


def check_kvcache_repeats(order: str, device) -> None:
    """`flash_attn_with_kvcache` along `KV_ORDERS[order]` on the same tensors: a call that
    appends writes its rows, so each call restores the cache first; between calls
    `cache_seqlens` is edited in place (the checks read it once per tensor version)."""
    state = {name: make_kv_inputs(case, device) for name, case in KV_SIGNATURES.items()}
    pristine = {name: (s["k_cache"].clone(), s["v_cache"].clone()) for name, s in state.items()}
    for i, name in enumerate(KV_ORDERS[order]):
        case, inputs = KV_SIGNATURES[name], state[name]
        inputs["k_cache"].copy_(pristine[name][0])
        inputs["v_cache"].copy_(pristine[name][1])
        if i >= 4:  # shorter sequences, same tensor: a new version the checks must read
            inputs["cache_seqlens"].sub_(1).clamp_(min=0)
            inputs["lens"] = inputs["cache_seqlens"].tolist()
        out, lse = call_kernel(case, inputs)
        high_out, _ = reference(case, inputs, torch.float64)
        low_out, _ = reference(case, inputs, case.dtype)
        check_close(f"call {i} ({name}) out", out.cpu(), high_out, low_out, factor=2.0)


@pytest.mark.parametrize("order", KV_ORDERS)
def test_kvcache_repeated_calls(order, device):
    check_kvcache_repeats(order, device)
