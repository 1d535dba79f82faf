"""Running the cases of tests/random_cases.py: each case's tensors, its calls (repeats included)
and the checks against `attention_reference` in higher precision by the pass rule described
there; `run_route` runs a route's cases and sums them up (`Summary`), with the command that
reruns each failure alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import traceback
from collections.abc import Callable

import torch
from attention_testing import check_close, lse_atol, max_error
from fusedlayers.kernels import decode_attention
from kvcache_testing import KVCase, call_kernel, check_cache, make_kv_inputs, reference
from random_cases import (
    DPA,
    F32,
    PAGED,
    Case,
    _canon,
    _cu,
    _layout,
    _pattern_shape,
    draw_case,
    limits_for,
    pinned_route,
)  # fmt: skip
from random_report import Summary

from fusedlayers import (
    DotProductAttention,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from fusedlayers.attention.reference import attention_reference


class _Training:
    """One training configuration's tensors: leaf buffers allocated once and refilled in place
    with fresh normals for every call (a training loop: same storage, new values), the views the
    entry point takes, the sequence metadata and the reference's arguments."""

    def __init__(self, case: Case, device):
        self.case, self.device = case, device
        shapes, self.views = _layout(case)
        g = torch.Generator().manual_seed(case.data_seed)
        self.meta, ref = self._sequences()
        if case.layout == "paged":
            shapes = self._pages(shapes, g)
        self.buffers = [torch.empty(s, dtype=case.dtype, device=device) for s in shapes]
        self.covered = self._coverage(shapes)
        bias_dtype = F32 if case.bias_fp32 else case.dtype
        self.bias = None
        if case.bias:
            self.bias = torch.empty(
                _pattern_shape(case.bias, case), dtype=bias_dtype, device=device
            )
        self.slopes = None
        if case.alibi:  # fp32 [h] or [b, h]
            shape = (case.h,) if case.alibi == "h" else (case.b, case.h)
            self.slopes = torch.empty(shape, dtype=F32, device=device)
        if case.arbitrary:
            keep = torch.rand(_pattern_shape(case.arbitrary, case), generator=g) < 0.6
            self.meta["attention_mask"] = ~keep.to(device)
            ref["attn_mask"] = self.meta["attention_mask"]
        window, bottom_right = self._semantics()
        scale = case.d**-0.5 if case.softmax_scale is None else case.softmax_scale
        self.scale = scale
        self.ref = dict(ref, softmax_scale=scale, window_size=window, bottom_right=bottom_right,
                        softcap=case.softcap, return_lse=True)  # fmt: skip
        self.leaves = self.buffers + ([self.bias] if case.bias_grad else [])
        self.refill(0)
        for t in self.leaves:
            t.requires_grad_()

    def _semantics(self) -> tuple[tuple[int, int], bool]:
        """The oracle's reading of the mask arguments: (window, bottom_right). TE: `causal` and
        `padding_causal` are top-left, every other type bottom-right; flash-attn: bottom-right,
        causal caps the right side of the window at 0."""
        c = self.case
        window = c.window or (-1, -1)
        causal = "causal" in c.mask
        if causal:
            window = (window[0], 0)
        bottom_right = c.entry != DPA or c.mask not in ("causal", "padding_causal")
        return window, bottom_right

    def _sequences(self) -> tuple[dict, dict]:
        """(entry keyword arguments, reference keyword arguments) for lengths and gaps."""
        c, dev = self.case, self.device
        i32 = lambda values: torch.tensor(values, dtype=torch.int32, device=dev)
        if c.qkv_format == "thd":
            meta = dict(cu_seqlens_q=i32(_cu(c.lens_q)), cu_seqlens_kv=i32(_cu(c.lens_kv)),
                        max_seqlen_q=c.s_q, max_seqlen_kv=c.s_kv)  # fmt: skip
            ref = dict(cu_seqlens_q=meta["cu_seqlens_q"], cu_seqlens_kv=meta["cu_seqlens_kv"])
            if c.gaps_q is not None:
                for side, lens, gaps in (("q", c.lens_q, c.gaps_q), ("kv", c.lens_kv, c.gaps_kv)):
                    padded = i32(_cu([n + gap for n, gap in zip(lens, gaps)]))
                    meta[f"cu_seqlens_{side}_padded"] = ref[f"cu_seqlens_{side}_padded"] = padded
            return meta, ref
        if c.padding_via is None:
            return {}, {}
        lens_q = c.lens_q if c.lens_q is not None else (c.s_q,) * c.b
        ref = dict(seqlens_q=i32(lens_q), seqlens_kv=i32(c.lens_kv))
        if c.padding_via == "cu_seqlens":
            return dict(cu_seqlens_q=i32(_cu(lens_q)), cu_seqlens_kv=i32(_cu(c.lens_kv))), ref

        def padding(lens, s):  # TE's padding mask [b, 1, 1, s], True = padded
            return (torch.arange(s, device=dev) >= i32(lens)[:, None])[:, None, None, :]

        kv_mask = padding(c.lens_kv, c.s_kv)
        if c.padding_via == "mask":
            return dict(attention_mask=kv_mask), ref
        return dict(attention_mask=(padding(lens_q, c.s_q), kv_mask)), ref

    def _pages(self, shapes, g):
        """Paged K/V: shuffled pages of `page_size` rows (two spare), -1 past each sequence's
        pages; sets the block table and the gather index of every logical key."""
        c, ps = self.case, self.case.page_size
        need = [math.ceil(n / ps) for n in c.lens_kv]
        num_blocks = sum(need) + 2
        order = torch.randperm(num_blocks, generator=g).tolist()
        table = torch.full((c.b, max(max(need), 1)), -1, dtype=torch.int32)
        pages, rows = [], []
        for z, (n, k) in enumerate(zip(c.lens_kv, need)):
            table[z, :k] = torch.tensor(order[:k], dtype=torch.int32)
            order = order[k:]
            pages += [int(table[z, j // ps]) for j in range(n)]
            rows += [j % ps for j in range(n)]
        self.meta["block_table"] = table.to(self.device)
        self.gather = tuple(
            torch.tensor(x, dtype=torch.long, device=self.device) for x in (pages, rows)
        )
        base = self.views
        self.views = lambda bufs: base([bufs[0], *(t[self.gather] for t in bufs[1:])])
        return [shapes[0], (num_blocks, ps, c.h_kv, c.d), (num_blocks, ps, c.h_kv, c.d_v)]

    def _coverage(self, shapes) -> list[torch.Tensor]:
        """Per buffer, True where a view reads it."""
        covered = [torch.zeros(s, dtype=torch.bool, device=self.device) for s in shapes]
        if self.case.layout == "paged":
            covered[0].fill_(True)
            for t in covered[1:]:
                t[self.gather] = True
            return covered
        for view in self.views(covered):
            view.fill_(True)
        return covered

    def _unowned_rows(self, side: str) -> list[tuple[int, slice]] | torch.Tensor:
        """Rows no sequence owns: (batch entry, rows) for a padded batch, a bool mask for thd."""
        c = self.case
        lens = c.lens_q if side == "q" else c.lens_kv
        if c.qkv_format != "thd":
            s = c.s_q if side == "q" else c.s_kv
            return [] if lens is None else [(z, slice(n, s)) for z, n in enumerate(lens)]
        gaps = c.gaps_q if side == "q" else c.gaps_kv
        owned = []
        for n, gap in zip(lens, gaps or (0,) * len(lens)):
            owned += [True] * n + [False] * gap
        return ~torch.tensor(owned, dtype=torch.bool, device=self.device)

    @torch.no_grad()
    def refill(self, call: int) -> None:
        """Fresh normals in every leaf (in place), NaN where nothing may be read, a new dout."""
        c = self.case
        g = torch.Generator().manual_seed(c.data_seed * 1009 + call)
        randn = lambda shape: torch.randn(shape, generator=g).to(self.device)
        for buf, covered in zip(self.buffers, self.covered):
            buf.copy_(randn(buf.shape))
            if c.poison:
                buf[~covered] = float("nan")
        if c.poison and c.layout != "paged":
            for view, side in zip(self.views(self.buffers), ("q", "kv", "kv")):
                unowned = self._unowned_rows(side)
                if isinstance(unowned, torch.Tensor):
                    view[unowned] = float("nan")
                for z, rows in unowned if isinstance(unowned, list) else ():
                    _canon(view, c.qkv_format)[z, rows] = float("nan")
        if self.bias is not None:
            self.bias.copy_(randn(self.bias.shape))
        if self.slopes is not None:  # ALiBi's geometric slopes, each scaled by 0.5..1.5
            geometric = 2.0 ** (-8.0 * torch.arange(1, c.h + 1) / c.h)
            self.slopes.copy_(geometric * (0.5 + torch.rand(self.slopes.shape, generator=g)))
        q = _canon(self.views(self.buffers)[0], c.qkv_format)
        self.dout = randn((*q.shape[:-1], c.d_v)).to(c.dtype)

    def call(self, module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The entry point on the current tensors -> (out as bshd/thd [.., h, d_v], lse)."""
        c, meta = self.case, self.meta
        q, k, v = self.views(self.buffers) if c.layout != "paged" else self.buffers
        if c.entry == DPA:
            out = module(q, k, v, **meta, **self._bias_kwargs())
            return _canon(out.unflatten(-1, (c.h, c.d_v)), c.qkv_format), None
        kw = dict(softmax_scale=c.softmax_scale, causal=c.mask == "causal",
                  window_size=c.window or (-1, -1), softcap=c.softcap, alibi_slopes=self.slopes,
                  deterministic=c.deterministic, return_attn_probs=c.return_lse)  # fmt: skip
        varlen = (meta.get("cu_seqlens_q"), meta.get("cu_seqlens_kv"), c.s_q, c.s_kv)
        if c.entry == "flash_attn_func":
            result = flash_attn_func(q, k, v, **kw)
        elif c.entry == "flash_attn_qkvpacked_func":
            result = flash_attn_qkvpacked_func(self.buffers[0], **kw)
        elif c.entry == "flash_attn_kvpacked_func":
            result = flash_attn_kvpacked_func(q, self.buffers[1], **kw)
        elif c.entry == "flash_attn_varlen_func":
            result = flash_attn_varlen_func(q, k, v, *varlen, **kw)
        elif c.entry == PAGED:
            result = flash_attn_varlen_func(q, k, v, *varlen, block_table=meta["block_table"], **kw)
        elif c.entry == "flash_attn_varlen_qkvpacked_func":
            result = flash_attn_varlen_qkvpacked_func(self.buffers[0], varlen[0], c.s_q, **kw)
        else:
            assert c.entry == "flash_attn_varlen_kvpacked_func", c.entry
            result = flash_attn_varlen_kvpacked_func(q, self.buffers[1], *varlen, **kw)
        return (result[0], result[1]) if c.return_lse else (result, None)

    def _bias_kwargs(self) -> dict:
        if self.bias is not None:
            return dict(core_attention_bias_type="post_scale_bias", core_attention_bias=self.bias)
        if self.slopes is not None:
            return dict(core_attention_bias_type="alibi", alibi_slopes=self.slopes)
        return {}

    def reference(self, dtype: torch.dtype) -> dict:
        """attention_reference on the current values cast to `dtype`: out, lse, dq, dk, dv
        [, dbias], as bshd/thd."""
        c = self.case
        bufs = [t.detach() for t in self.buffers]
        q, k, v = (_canon(t, c.qkv_format).to(dtype) for t in self.views(bufs))
        q, k, v, kwargs, rows_k = self._without_empty_keys(q, k, v)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        bias = None if self.bias is None else self.bias.detach().to(dtype).requires_grad_()
        slopes = None if self.slopes is None else self.slopes.detach()
        out, lse = attention_reference(q, k, v, bias=bias, alibi_slopes=slopes, **kwargs)
        leaves = [q, k, v] + ([bias] if c.bias_grad else [])
        shift = self._delta_rounding(out, lse, leaves) if dtype != c.dtype else {}
        dq, dk, dv, *dbias = torch.autograd.grad(out, leaves, self.dout.to(out.dtype))
        result = dict(out=out.detach(), lse=lse.detach(), dq=dq, dk=dk[:rows_k], dv=dv[:rows_k])
        result.update(zip(("dbias",), dbias))
        result["delta_shift"] = {
            n: t[:rows_k] if n in ("dk", "dv") else t for n, t in shift.items()
        }
        return result

    def _delta_rounding(self, out, lse, leaves) -> dict:
        """How far the kernels' gradients move because their D = rowsum(dO * O) takes the output
        rounded to the input dtype (FlashAttention-2), where the reference keeps it exact: with
        delta_i = rowsum(dO * (round(O) - O)), dS_ij moves by -P_ij delta_i, the gradient of
        -sum_i delta_i LSE_i; autograd gives it through the high-precision reference. Largest
        with peaked rows (large scores, few keys). Only an atol term (`_grad_atol`)."""
        c = self.case
        out = out.detach()
        delta = ((out.to(c.dtype).to(out.dtype) - out) * self.dout.to(out.dtype)).sum(-1)
        delta = delta.transpose(0, 1) if c.qkv_format == "thd" else delta.transpose(1, 2)
        delta = torch.where(torch.isfinite(lse), delta, 0.0)
        grads = torch.autograd.grad(lse, leaves, -delta.to(lse.dtype), retain_graph=True,
                                    allow_unused=True)  # fmt: skip
        names = ("dq", "dk", "dv", "dbias")
        return {n: torch.nan_to_num(g, nan=0.0) for n, g in zip(names, grads) if g is not None}

    def _without_empty_keys(self, q, k, v):
        """attention_reference cannot take a sequence with no keys (its row max reduces over an
        empty dim). Such a sequence gets one zero key that a mask hides from all its queries:
        output 0, LSE -inf and zero gradients, as the kernels must give. thd: the key is a row
        appended after the last (`cu_seqlens_kv_padded` points at it; its gradient is dropped);
        a padded batch: row 0 of the sequence (a padded row, whose gradient must be 0).
        Returns (q, k, v, reference kwargs, rows of k/v to keep)."""
        c, kwargs, rows_k = self.case, dict(self.ref), k.shape[0]
        empty = [z for z, n in enumerate(c.lens_kv or ()) if n == 0]
        if not empty:
            return q, k, v, kwargs, rows_k
        assert "attn_mask" not in kwargs
        dev, lens = q.device, [max(n, 1) for n in c.lens_kv]
        hidden = torch.zeros(c.b, 1, 1, 1, dtype=torch.bool, device=dev)
        hidden[empty] = True
        kwargs["attn_mask"] = hidden
        k, v = k.clone(), v.clone()
        if c.qkv_format != "thd":
            k[empty, 0], v[empty, 0] = 0, 0
            kwargs["seqlens_kv"] = torch.tensor(lens, dtype=torch.int32, device=dev)
            return q, k, v, kwargs, rows_k
        starts = _cu([n + gap for n, gap in zip(c.lens_kv, c.gaps_kv or (0,) * c.b)])[:-1]
        starts = [rows_k if n == 0 else start for n, start in zip(c.lens_kv, starts)]
        kwargs["cu_seqlens_kv"] = torch.tensor(_cu(lens), dtype=torch.int32, device=dev)
        kwargs["cu_seqlens_kv_padded"] = torch.tensor(starts + [rows_k + 1], dtype=torch.int32,
                                                      device=dev)  # fmt: skip
        k, v = (torch.cat((t, t.new_zeros(1, *t.shape[1:]))) for t in (k, v))
        return q, k, v, kwargs, rows_k

    def kernel(self, module, mode: str) -> dict:
        """One call of the entry in `mode`: out[, lse][, dq, dk, dv[, dbias]] as bshd/thd, and
        "unread_grad", the largest gradient on buffer memory no view reads (must be 0)."""
        with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
            out, lse = self.call(module)
        result = dict(out=out.detach().clone())
        if lse is not None:
            result["lse"] = lse.detach().clone()
        if mode == "no_grad":
            return result
        if mode == "grad":
            grads = torch.autograd.grad(out, self.leaves, self.dout, allow_unused=True)
        else:
            for t in self.leaves:
                if t.grad is not None:
                    t.grad.zero_()  # as optimizer.zero_grad(set_to_none=False) does
            out.backward(self.dout)
            grads = [t.grad for t in self.leaves]
        grads = [torch.zeros_like(t) if g is None else g.detach().clone()
                 for t, g in zip(self.leaves, grads)]  # fmt: skip
        n = len(self.buffers)
        dq, dk, dv = (_canon(t, self.case.qkv_format) for t in self.views(grads[:n]))
        result.update(dq=dq, dk=dk, dv=dv)
        if self.case.bias_grad:
            result["dbias"] = grads[n]
        unread = [g[~cov].abs().max().item() for g, cov in zip(grads, self.covered) if
                  (~cov).any()]  # fmt: skip
        result["unread_grad"] = max(unread, default=0.0)
        return result


# ----------------------------------------------------------------------------- checking


def _high_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """fp64 on the CPU; fp32 on CUDA, fp64 for fp32 inputs (an fp32 reference would show
    PyTorch's fp32 error as 0)."""
    return torch.float64 if torch.device(device).type != "cuda" or dtype == F32 else F32


def _product_unit(state: _Training) -> float:
    """One fp32 unit of a gradient term that goes through dP = dO V^T and one P-weighted product
    with K or Q: eps32 * scale * |dO| |V| |Q or K|."""
    q, k, v = state.views([t.detach() for t in state.buffers])
    magnitude = _largest(state.dout) * _largest(v) * max(_largest(q), _largest(k))
    return torch.finfo(F32).eps * state.scale * magnitude


def _zero_grad_atol(unit: float, d_v: int) -> float:
    """atol of a gradient that is exactly 0 in the reference (every query sees one key: its
    softmax weight is exactly 1 and dS = P (dP - D) cancels exactly in PyTorch, fp32 included).
    The kernels take D = rowsum(dO * O) in fp32 (FlashAttention-2), so one fp32 rounding of the
    cancelled terms is left: d_v units (`_product_unit`)."""
    return unit * d_v


def _score_atol(state: _Training) -> float:
    """What the scores' dot products may carry beyond PyTorch's fp32 matmul: the kernels'
    `tl.dot` accumulates on tensor cores, whose fp32 sums are not rounded to nearest after every
    add, about sqrt(d) fp32 units of |q| |k| per score (scaled). With few keys the LSE is a score
    (one key: exactly), so it bounds the LSE's error there: measured on an H200, 5-6 units at
    d = 160-192 where `lse_atol` allowed 3 (tests/gpu/test_random_differential_gpu.py)."""
    q, k, _ = state.views([t.detach() for t in state.buffers])
    return torch.finfo(F32).eps * state.scale * math.sqrt(state.case.d) * _largest(q) * _largest(k)


def _product_atol(unit: float, d_v: int) -> float:
    """What the backward's dP = dO V^T products may carry beyond PyTorch's fp32 matmul, as
    `_score_atol` for the scores: about sqrt(d_v) units (`_product_unit`; the kernels and cuBLAS
    sum in different orders). Visible in fp32 only: an H200 gave dK 1.07x the bound without it
    (fp32, ALiBi, padding_causal, 2 x 256 keys; `FOUND` in the GPU test)."""
    return unit * math.sqrt(d_v)


def _largest(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return finite.abs().max().item() if finite.numel() else 0.0


def _grad_atol(
    actual, want, lse_size: float, shift: torch.Tensor | None, zero_atol: float,
    product_atol: float,
):  # fmt: skip
    """One unit of the gradient's dtype at its magnitude (check_close's atol), plus what two
    documented choices of the kernels' backward (FlashAttention-2's) cost beyond PyTorch's own
    error, which the pass rule's "low" run (the reference fed input-dtype tensors, computing in
    fp32) does not share:
    - P = exp2((s - LSE) log2 e) recomputed in fp32 from the stored LSE: a relative error of
      about 2 eps32 |LSE| on every P, which PyTorch's softmax (normalized by its sum) does not
      have; it shows in fp32 with large scores. The gradients sum dS = P (dP - D) over keys
      with cancellation (each row of dS sums to 0), so their error is relative to the sum of
      magnitudes, not to the result: four units, as tests/test_kernels_backward_unit.py allows
      (two let fp32 dQ/dK through at 1.2-1.3x the bound in 4 of 160 fp32 GPU cases).
    - D = rowsum(dO * O) from the output rounded to the input dtype: twice its first-order
      effect `shift` (`_Training._delta_rounding`), largest for fp16/bf16 with peaked rows.
    - dP's products summed in another order than cuBLAS's: `product_atol` (`_product_atol`).
    A gradient that is exactly 0 in the reference gets at least `zero_atol` (`_zero_grad_atol`)."""
    magnitude = max(_largest(want), 1.0)
    atol = (torch.finfo(actual.dtype).eps + 4 * torch.finfo(F32).eps * lse_size) * magnitude
    atol += product_atol
    if shift is not None:
        atol += 2 * _largest(shift)
    if zero_atol and _largest(want) == 0.0:
        atol = max(atol, zero_atol)
    return atol


def compare(
    kernel: dict, high: dict, low: dict, s_kv: int, zero_atol: float = 0.0,
    score_atol: float = 0.0, product_atol: float = 0.0,
) -> list[str]:  # fmt: skip
    """The pass rule on every result the kernel produced; one line per failure. The output
    shares the gradients' exp2-domain term (2 fp32 units of |LSE| on every P, in the forward
    too: 1.1-4x PyTorch's fp32 error with ALiBi's large scores); the LSE adds `score_atol`."""
    problems, lse_size = [], _largest(high["lse"]) if "lse" in high else 0.0
    shifts = high.get("delta_shift", {})
    for name in ("out", "lse", "dq", "dk", "dv", "dbias"):
        if name not in kernel:
            continue
        actual, want, pytorch = kernel[name], high[name], low[name]
        factor, atol = (3.0, None) if name.startswith("d") else (2.0, None)
        if name == "lse":
            atol = lse_atol(want, s_kv) + score_atol
        elif name == "out":
            magnitude = max(_largest(want), 1.0)
            atol = (torch.finfo(actual.dtype).eps + 2 * torch.finfo(F32).eps * lse_size) * magnitude
        elif name.startswith("d"):
            atol = _grad_atol(actual, want, lse_size, shifts.get(name), zero_atol, product_atol)
        try:
            check_close(name, actual, want, pytorch, factor=factor, atol=atol)
        except AssertionError as error:
            err, pt = max_error(actual, want), max_error(pytorch, want)
            ratio = err / pt if pt > 0 else math.inf
            problems.append(
                f"{name}: kernel error {err:.3e}, PyTorch {pytorch.dtype} error {pt:.3e}, "
                f"ratio {ratio:.2f} -- {str(error).splitlines()[0]}"
            )
    if kernel.get("unread_grad", 0.0) != 0.0:
        problems.append(f"gradient {kernel['unread_grad']:.3e} on buffer memory no view reads")
    return problems


class Rejected(Exception):
    """An entry point refused the first call of a configuration (ValueError/TypeError)."""


def _modules_take_kernels(device) -> bool:
    """Whether DotProductAttention runs the kernels on `device`: on a CPU only under the
    `kernels_on_cpu` fixture (tests/conftest.py); otherwise it takes the reference path, and a
    case would compare the reference with itself."""
    if torch.device(device).type == "cuda":
        return True
    from fusedlayers.attention import frontend

    choose = getattr(frontend, "choose_backend", None) or frontend._choose_backend
    probe = torch.empty(1, 1, 1, 1)
    try:
        return choose("auto", probe, "query_layer")[0]
    except TypeError:  # the older (backend, q) signature
        return choose("auto", probe)[0]


def _make_module(case: Case, device):
    if case.entry != DPA:
        return None
    if not _modules_take_kernels(device):
        raise RuntimeError(
            "DotProductAttention takes the reference path on CPU tensors: run CPU cases under "
            "the `kernels_on_cpu` fixture (tests/conftest.py)"
        )
    return DotProductAttention(
        case.h, case.d if case.d == case.d_v else (case.d, case.d_v), num_gqa_groups=case.h_kv,
        qkv_format=case.qkv_format, attn_mask_type=case.mask, window_size=case.window,
        attention_type="self" if case.s_q == case.s_kv else "cross",
        softmax_scale=case.softmax_scale, deterministic=case.deterministic,
    )  # fmt: skip


@contextlib.contextmanager
def _rejected_if(first: bool):
    """An entry's refusal (ValueError/TypeError) of a configuration's first call makes the draw
    `Rejected`, not a failure; a later call of the same configuration must not raise."""
    try:
        yield
    except (ValueError, TypeError) as error:
        if first:
            raise Rejected(f"{type(error).__name__}: {error}") from error
        raise


def _run_training_calls(case: Case, device, label: str) -> list[str]:
    state, module = _Training(case, device), _make_module(case, device)
    high_dtype, problems, first = _high_dtype(case.dtype, device), [], True
    for i, mode in enumerate(case.calls):
        if mode == "other":
            problems += _run_calls(case.other, device, f"{label}call {i + 1} (other) ")
            continue
        state.refill(i)
        with _rejected_if(first):
            result = state.kernel(module, mode)
        first = False
        where = f"{label}call {i + 1} ({mode}): "
        high, low = state.reference(high_dtype), state.reference(case.dtype)
        unit = _product_unit(state)
        atols = dict(zero_atol=_zero_grad_atol(unit, case.d_v), score_atol=_score_atol(state),
                     product_atol=_product_atol(unit, case.d_v))  # fmt: skip
        problems += [where + p for p in compare(result, high, low, case.s_kv, **atols)]
        if case.deterministic and mode != "no_grad":  # bitwise the same on the same inputs
            again = state.kernel(module, mode)
            for name in ("out", "dq", "dk", "dv", "dbias"):
                if name in result and not torch.equal(result[name], again[name]):
                    problems.append(where + f"{name} differs bitwise between two deterministic "
                                    "calls on the same inputs")  # fmt: skip
    return problems


def _decode_kernel(kv: KVCase, inputs: dict):
    """`decode_attention` directly on the (already appended) cache."""
    b, h = kv.b, kv.h
    left, right = (kv.window[0], 0) if kv.causal else kv.window
    slopes = inputs["alibi_slopes"]
    return decode_attention(
        inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["cache_seqlens"],
        block_table=inputs["block_table"], cache_batch_idx=inputs["cache_batch_idx"],
        cache_leftpad=inputs["cache_leftpad"], softmax_scale=kv.d**-0.5, window_left=left,
        window_right=right, softcap=kv.softcap,
        alibi_slopes=None if slopes is None else slopes.expand(b, h), num_splits=kv.num_splits,
    )  # fmt: skip


def _rotary_past_table(kv: KVCase, inputs: dict) -> str:
    """A complaint when the call was accepted although a query's rotary position lies past the
    rotary tables: with causal or windowed attention query i is rotated at cache_seqlens + i, so
    s_q > s_new reaches past the last appended row, and nothing defines the rotation there."""
    if kv.rotary is None or not (kv.causal or kv.window != (-1, -1)):
        return ""
    last = max(inputs["lens"]) + kv.s_q - 1
    rows = inputs["rotary_cos"].shape[0]
    if last < rows:
        return ""
    return (
        f"accepted: query rotary positions reach {last}, past the {rows} rows of rotary_cos/"
        f"rotary_sin (s_q {kv.s_q} > s_new {kv.s_new}); it must raise or stay in the tables"
    )


def _run_decode_calls(case: Case, device, label: str) -> list[str]:
    problems, first = [], True
    for i, mode in enumerate(case.calls):
        if mode == "other":
            problems += _run_calls(case.other, device, f"{label}call {i + 1} (other) ")
            continue
        kv = dataclasses.replace(case.kv, seed=case.kv.seed + i)  # new values, one signature
        inputs = make_kv_inputs(kv, device)
        before = (inputs["k_cache"].cpu().clone(), inputs["v_cache"].cpu().clone())
        with _rejected_if(first):
            with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
                if case.entry == "decode_attention":
                    out, lse = _decode_kernel(kv, inputs)
                else:
                    out, lse = call_kernel(kv, inputs)
        first = False
        where = f"{label}call {i + 1} ({mode}): "
        past = _rotary_past_table(kv, inputs)
        if past:
            problems.append(where + past)
            continue
        try:
            check_cache(kv, inputs, before)
        except AssertionError as error:
            problems.append(where + "cache: " + str(error).splitlines()[0])
        high_out, high_lse = reference(kv, inputs, torch.float64)
        low_out, low_lse = reference(kv, inputs, kv.dtype)
        kernel = dict(out=out.cpu(), lse=lse.cpu())
        high, low = dict(out=high_out, lse=high_lse.float()), dict(out=low_out, lse=low_lse)
        problems += [where + p for p in compare(kernel, high, low, kv.s_cache)]
    return problems


def _run_calls(case: Case, device, label: str = "") -> list[str]:
    if case.route == "decode":
        return _run_decode_calls(case, device, label)
    return _run_training_calls(case, device, label)


def _where(error: Exception) -> list[str]:
    """The last frames of a crash inside this project (library, kernels, tests), innermost last."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "site-packages" not in f.filename and "/lib/python" not in f.filename]  # fmt: skip
    return [f"  at {f.filename}:{f.lineno} in {f.name}: {f.line}" for f in frames[-4:]]


def run_case(case: Case, device) -> tuple[str, list[str]]:
    """("pass" | "fail" | "rejected", problems) for every call of `case`, on its route."""
    try:
        with pinned_route(case.route):
            problems = _run_calls(case, device)
    except Rejected as rejection:
        return "rejected", [str(rejection)]
    except Exception as error:  # a crash of any other kind is a failure
        return "fail", [f"crash: {type(error).__name__}: {error}", *_where(error)]
    return ("fail" if problems else "pass"), problems


# ----------------------------------------------------------------------------- a route


def run_route(
    route: str,
    seed: int,
    count: int,
    device,
    *,
    only: list[int] | None = None,
    shard: tuple[int, int] = (0, 1),
    stop_at: float | None = None,
    rerun: Callable[[int], str] = str,
    log: Callable[[str], None] = print,
) -> Summary:
    """Run cases 0..count-1 of `route` (or the indices in `only`); log the seed first and each
    failure with its case, errors and `rerun(index)` command as it happens.

    shard (k, n): only the indices i with i % n == k, so that n tests (xdist workers, GPUs)
    share one route's cases. stop_at: a `time.time()` after which no new case starts; the
    cases left are counted in `Summary.not_run`, so a time-boxed run reports what it covered."""
    k, n = shard
    summary = Summary(route, seed, torch.device(device).type, f"{k}/{n}" if n > 1 else "")
    limits = limits_for(device)
    indices = [i for i in (range(count) if only is None else only) if i % n == k]
    log(f"random differential: route {route}, seed {seed}, {len(indices)} cases on {device}; "
        f"rerun one with: {rerun('<index>')}")  # fmt: skip
    start, every = time.perf_counter(), max(10, len(indices) // 10)
    for done, index in enumerate(indices):
        if stop_at is not None and time.time() >= stop_at:
            summary.not_run = len(indices) - done
            break
        if done and done % every == 0:
            log(f"  {done}/{len(indices)} cases, {summary.counts['failed']} failed "
                f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
        case = draw_case(route, seed, index, limits)
        status, problems = run_case(case, device)
        if status == "pass":
            summary.counts["passed"] += 1
        elif status == "rejected":
            summary.counts["rejected"] += 1
            summary.rejections.append(dict(index=index, case=str(case), reason=problems[0]))
        else:
            summary.counts["failed"] += 1
            failure = dict(index=index, case=str(case), problems=problems, rerun=rerun(index))
            summary.failures.append(failure)
            log(f"FAIL case {index}: {case}\n" + "\n".join(f"    {p}" for p in problems)
                + f"\n    rerun: {failure['rerun']}")  # fmt: skip
    summary.seconds = time.perf_counter() - start
    log(summary.line())
    return summary
