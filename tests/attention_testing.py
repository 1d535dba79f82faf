"""Shared harness for the attention kernel tests (CPU interpreter and GPU suites).

The pass rule (design.md, flash-attn's): a kernel result passes when its max error against a
high-precision reference is at most `factor` times the max error of PyTorch doing the same
computation in the input dtype, plus a small atol; `factor` is 2 for forward outputs and 3 for
gradients. "High" is the reference in fp64 (CPU) or fp32 (GPU); "low" is the same reference fed
the input-dtype tensors, with results in the input dtype.

Layout legend: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d(_v)]; varlen q [t_q, h, d],
k/v [t_k, h_kv, d(_v)]; bias broadcast to [b, h, s_q, s_k]; LSE dense [b, h, s_q] / varlen
[h, t_q].

Gradients are those of sum(out * dout), plus sum(lse * dlse) for `Case(lse_grad=True)`: a loss
that reads the LSE too (attention sinks do), whose gradient the backward folds into delta.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import torch
from fusedlayers.kernels import dropout_keep_mask, flash_attention

from fusedlayers.attention.reference import attention_reference

GRAD_NAMES = ("dq", "dk", "dv", "dbias")


class KernelSpy:
    """Stands in for a Triton kernel (a module global the launcher looks up per call): records
    the grid and keyword arguments of every launch, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.grids = kernel, [], []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.grids.append(grid)
            self.launches.append(kwargs)
            return launch(*args, **kwargs)

        return run


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem. `s_q`/`s_k` are the padded (dense) or max (varlen) lengths.

    layout: "dense"; "seqlens" (dense, right-padded, random valid lengths); "varlen" (thd with
    cu_seqlens); "varlen_padded" (thd with gaps between sequences, `seq_offsets`).
    bias: None or a broadcast pattern over [b, h, s_q, s_k], e.g. "1hss", "111s", passed to the
    kernel as an expand()ed view. alibi: None, "batch" ([b, h] slopes) or "shared" ([1, h]
    expanded over the batch, stride 0). empty_k: make the last sequence's key length 0 (varlen).
    lse_grad: the loss reads the LSE too (a random fp32 `dlse`, the LSE's upstream gradient).
    """

    b: int = 2
    s_q: int = 9
    s_k: int = 13
    h: int = 2
    h_kv: int = 2
    d: int = 16
    d_v: int | None = None
    dtype: torch.dtype = torch.float16
    window: tuple[int, int] = (-1, -1)
    bottom_right: bool = True
    bias: str | None = None
    alibi: str | None = None
    softcap: float = 0.0
    dropout_p: float = 0.0
    layout: str = "dense"
    softmax_scale: float | None = None
    deterministic: bool = False
    empty_k: bool = False
    seed: int = 0
    lse_grad: bool = False

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1 / math.sqrt(self.d)

    @property
    def varlen(self) -> bool:
        return self.layout.startswith("varlen")

    def label(self) -> str:
        """Short id listing only what differs from the defaults."""
        base = Case()
        parts = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(base, f.name)
        ]
        return ",".join(parts).replace("torch.", "") or "default"


def _lengths(max_len: int, b: int, g: torch.Generator, empty_last: bool = False) -> list[int]:
    """b random lengths in [2, max_len] (1 if max_len is), the first equal to max_len.

    No random length 1: a sequence with one key has dk = 0 exactly, and flash attention's
    D = rowsum(dO * O), taken from the output rounded to the input dtype (as in FlashAttention-2),
    leaves a rounding-level dk there that the pass rule's atol does not cover.
    """
    lens = torch.randint(min(2, max_len), max_len + 1, (b,), generator=g).tolist()
    lens[0] = max_len
    if empty_last and b > 1:
        lens[-1] = 0
    return lens


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _offsets(lens: list[int], g: torch.Generator) -> tuple[torch.Tensor, int]:
    """Start rows with 1..3 unused rows before each sequence; (int32 [b+1], total rows)."""
    starts, row = [], 0
    for n in lens:
        row += int(torch.randint(1, 4, (1,), generator=g))
        starts.append(row)
        row += n
    return torch.tensor([*starts, row], dtype=torch.int32), row + 2


def make_inputs(case: Case, device: str | torch.device) -> dict:
    """Fresh random (never zero) inputs for `case` in its dtype, plus the sequence metadata.

    Keys: q, k, v, dout, dlse (fp32, laid out like the LSE, or None unless `case.lse_grad`),
    bias_leaf (the un-expanded bias or None), alibi_slopes, and the kernel's sequence arguments
    (cu_seqlens_q/k, seq_offsets_q/k, max_seqlen_q/k, seqlens_q/k).
    """
    g = torch.Generator().manual_seed(case.seed)
    d_v = case.d_v or case.d
    meta = dict.fromkeys(
        ("cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q", "seq_offsets_k", "seqlens_q")
        + ("seqlens_k", "max_seqlen_q", "max_seqlen_k")
    )
    if case.varlen:
        lens_q = _lengths(case.s_q, case.b, g)
        lens_k = _lengths(case.s_k, case.b, g, empty_last=case.empty_k)
        meta.update(cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k))
        meta.update(max_seqlen_q=case.s_q, max_seqlen_k=case.s_k)
        rows_q, rows_k = sum(lens_q), sum(lens_k)
        if case.layout == "varlen_padded":
            meta["seq_offsets_q"], rows_q = _offsets(lens_q, g)
            meta["seq_offsets_k"], rows_k = _offsets(lens_k, g)
        shape_q, shape_k = (rows_q,), (rows_k,)
    else:
        shape_q, shape_k = (case.b, case.s_q), (case.b, case.s_k)
        if case.layout == "seqlens":
            meta["seqlens_q"] = torch.tensor(_lengths(case.s_q, case.b, g), dtype=torch.int32)
            meta["seqlens_k"] = torch.tensor(_lengths(case.s_k, case.b, g), dtype=torch.int32)
    meta = {k: v.to(device) if torch.is_tensor(v) else v for k, v in meta.items()}

    def randn(*shape, dtype=case.dtype):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    inputs = dict(
        q=randn(*shape_q, case.h, case.d),
        k=randn(*shape_k, case.h_kv, case.d),
        v=randn(*shape_k, case.h_kv, d_v),
        dout=randn(*shape_q, case.h, d_v),
        bias_leaf=None,
        alibi_slopes=None,
    )
    if case.bias is not None:
        full = dict(b=case.b, h=case.h)
        dims = [1 if c == "1" else full.get(c) for c in case.bias[:2]]
        dims += [1 if c == "1" else n for c, n in zip(case.bias[2:], (case.s_q, case.s_k))]
        inputs["bias_leaf"] = randn(*dims)
    if case.alibi is not None:
        # ALiBi's geometric slopes 2^(-8 i / h), randomly scaled by 0.5..1.5 per entry.
        geometric = 2.0 ** (-8.0 * torch.arange(1, case.h + 1) / case.h)
        rows = case.b if case.alibi == "batch" else 1
        jitter = 0.5 + torch.rand(rows, case.h, generator=g)
        inputs["alibi_slopes"] = (geometric * jitter).to(device=device, dtype=torch.float32)
    # Drawn last, so the other inputs of a case are the same with and without it.
    inputs["dlse"] = None
    if case.lse_grad:
        lse_shape = (case.h, shape_q[0]) if case.varlen else (case.b, case.h, case.s_q)
        inputs["dlse"] = randn(*lse_shape, dtype=torch.float32)
    return {**inputs, **meta}


def poison_unowned_rows(inputs: dict, layout: str, names: tuple[str, ...]) -> None:
    """Fill with NaN, in place, the rows of `inputs[name]` no sequence owns: rows past each
    length ("seqlens") or the gaps between varlen sequences ("varlen_padded"). `names` are input
    keys among q, k, v and dout; q and dout follow the query lengths, k and v the key lengths."""
    for name in names:
        t, seq = inputs[name], "k" if name in ("k", "v") else "q"
        if layout == "seqlens":
            lens = inputs[f"seqlens_{seq}"]
            rows = torch.arange(t.shape[1], device=t.device)
            t[rows[None, :] >= lens[:, None]] = float("nan")
        else:
            t[~owned_rows(inputs, seq)] = float("nan")


def owned_rows(inputs: dict, seq: str) -> torch.Tensor:
    """Bool [rows] of a "varlen_padded" input: True on the rows some sequence owns (of the query
    sequences for seq "q", the key ones for "k"), False on the gaps between them."""
    starts, lens = inputs[f"seq_offsets_{seq}"][:-1], inputs[f"cu_seqlens_{seq}"].diff()
    rows = inputs["q" if seq == "q" else "k"].shape[0]
    owned = torch.zeros(rows, dtype=torch.bool, device=starts.device)
    for start, n in zip(starts.tolist(), lens.tolist()):
        owned[start : start + n] = True
    return owned


def keep_mask(case: Case, rng_state: torch.Tensor, device) -> torch.Tensor | None:
    """The kernels' keep-mask [b, h, s_q, s_k] (positions within each sequence), or None."""
    if case.dropout_p <= 0:
        return None
    return dropout_keep_mask(rng_state, case.b, case.h, case.s_q, case.s_k, case.dropout_p, device)


def _leaves(inputs: dict, dtype: torch.dtype) -> dict:
    """Differentiable copies of q, k, v (and the bias leaf) in `dtype`."""
    leaves = {n: inputs[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v")}
    if inputs["bias_leaf"] is not None:
        leaves["bias"] = inputs["bias_leaf"].detach().to(dtype).requires_grad_()
    return leaves


def _grads(out: torch.Tensor, lse: torch.Tensor, leaves: dict, inputs: dict) -> dict:
    """Gradients of sum(out * dout) (+ sum(lse * dlse) where `inputs["dlse"]` is given)."""
    names = [n for n in ("q", "k", "v", "bias") if n in leaves]
    outputs, upstream = [out], [inputs["dout"].to(out.dtype)]
    if inputs.get("dlse") is not None:
        outputs.append(lse)
        upstream.append(inputs["dlse"].to(lse.dtype))
    grads = torch.autograd.grad(outputs, [leaves[n] for n in names], upstream)
    return {f"d{n}": gr for n, gr in zip(names, grads)}


def _bias_view(case: Case, leaf: torch.Tensor | None) -> torch.Tensor | None:
    return None if leaf is None else leaf.expand(case.b, case.h, case.s_q, case.s_k)


def run_kernel(case: Case, inputs: dict, rng_state=None, backward: bool = True) -> dict:
    """flash_attention forward (+ backward with `dout`): out, lse, dq, dk, dv[, dbias]."""
    leaves = _leaves(inputs, case.dtype)
    meta = {k: inputs[k] for k in inputs if "seqlen" in k or "offsets" in k}
    slopes = inputs["alibi_slopes"]
    out, lse = flash_attention(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        **meta,
        softmax_scale=case.scale,
        window_size=case.window,
        bottom_right=case.bottom_right,
        bias=_bias_view(case, leaves.get("bias")),
        alibi_slopes=None if slopes is None else slopes.expand(case.b, case.h),
        softcap=case.softcap,
        dropout_p=case.dropout_p,
        rng_state=rng_state,
        deterministic=case.deterministic,
    )
    result = dict(out=out.detach(), lse=lse.detach())
    if backward:
        result.update(_grads(out, lse, leaves, inputs))
    return result


def run_reference(case: Case, inputs: dict, dtype: torch.dtype, keep=None) -> dict:
    """attention_reference on the inputs cast to `dtype` (fp64/fp32 = high, input dtype = low)."""
    leaves = _leaves(inputs, dtype)
    out, lse = attention_reference(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        cu_seqlens_q=inputs["cu_seqlens_q"],
        cu_seqlens_kv=inputs["cu_seqlens_k"],
        cu_seqlens_q_padded=inputs["seq_offsets_q"],
        cu_seqlens_kv_padded=inputs["seq_offsets_k"],
        seqlens_q=inputs["seqlens_q"],
        seqlens_kv=inputs["seqlens_k"],
        softmax_scale=case.scale,
        window_size=case.window,
        bottom_right=case.bottom_right,
        bias=_bias_view(case, leaves.get("bias")),
        alibi_slopes=inputs["alibi_slopes"],
        softcap=case.softcap,
        dropout_p=case.dropout_p,
        dropout_mask=keep,
        return_lse=True,
    )
    return dict(out=out.detach(), lse=lse.detach(), **_grads(out, lse, leaves, inputs))


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |actual - expected| over entries where `expected` is finite (0.0 when none are)."""
    finite = torch.isfinite(expected)
    if not finite.any():
        return 0.0
    return (actual.double()[finite] - expected.double()[finite]).abs().max().item()


def check_close(
    name: str,
    actual: torch.Tensor,
    high: torch.Tensor,
    low: torch.Tensor,
    *,
    factor: float,
    atol: float | None = None,
) -> dict:
    """Assert the pass rule for one tensor; returns {error, pytorch_error, bound} for summaries.

    Non-finite entries of `high` (LSE -inf on empty rows) must be reproduced exactly; NaN never
    passes. The default atol is one unit (eps) of the result's dtype at the reference's magnitude,
    at least 1 (fp32 for the LSE): it absorbs rounding where exact cancellation makes the low
    run's error 0 (e.g. dq with a single visible key) while the kernel's order of operations
    leaves one unit behind.
    """
    assert actual.shape == high.shape, f"{name}: shape {tuple(actual.shape)} != {high.shape}"
    assert not torch.isnan(actual).any(), f"{name}: NaN in kernel result"
    mismatch = torch.isfinite(actual) != torch.isfinite(high)
    bad = (actual != high) & ~torch.isfinite(high)
    assert not (mismatch | bad).any(), (
        f"{name}: non-finite pattern differs from the reference at "
        f"{(mismatch | bad).nonzero()[:5].tolist()}"
    )
    error, pytorch_error = max_error(actual, high), max_error(low, high)
    if atol is None:
        finite = high[torch.isfinite(high)]
        magnitude = finite.abs().max().item() if finite.numel() else 0.0
        atol = torch.finfo(actual.dtype).eps * max(magnitude, 1.0)
    bound = factor * pytorch_error + atol
    assert error <= bound, (
        f"{name}: kernel max error {error:.3e} > {factor:g} x PyTorch {low.dtype} error "
        f"{pytorch_error:.3e} + atol {atol:.1e} (= {bound:.3e})"
    )
    return dict(error=error, pytorch_error=pytorch_error, bound=bound)


def check_case(case: Case, device, *, high_dtype=torch.float64, backward: bool = True) -> dict:
    """Run kernel and references for `case` and apply the pass rule to every result.

    Dropout cases draw one rng_state, run the kernel with it and feed the reference the matching
    `dropout_keep_mask`. Returns {name: check_close(...)} for summaries.

    The rng_state is drawn from the case's seed, as the inputs are: drawn from the global
    generator, it depended on which tests ran before in the process, and one fp32 dropout case
    (p = 0.5, a bias) failed dK in 1 of 40 draws by 5%, the order of the dP sums
    (tests/random_runner.py `_product_atol` bounds that for the randomized test).
    """
    inputs = make_inputs(case, device)
    draw = torch.Generator().manual_seed(case.seed)
    rng_state = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64, generator=draw)
    keep = keep_mask(case, rng_state, device)
    kernel = run_kernel(case, inputs, rng_state if case.dropout_p > 0 else None, backward)
    high = run_reference(case, inputs, high_dtype, keep)
    low = run_reference(case, inputs, case.dtype, keep)
    return check_results(kernel, high, low, case.s_k)


def lse_atol(lse: torch.Tensor, s_k: int) -> float:
    """atol for the fp32 LSE: 2 + sqrt(s_k) fp32 units at its magnitude. The kernel and the
    reference sum up to s_k terms in different orders, and the kernel's exp2-domain statistics
    cost two more units converting back (max * log2(e), then * ln 2), which is all there is when
    s_k = 1. Against an fp32 "high" reference PyTorch's own LSE error is exactly 0 (both runs
    compute it in fp32), so the atol alone bounds it."""
    finite = lse[torch.isfinite(lse)]
    magnitude = finite.abs().max().item() if finite.numel() else 0.0
    return torch.finfo(torch.float32).eps * max(magnitude, 1.0) * (2 + math.sqrt(s_k))


def check_results(kernel: dict, high: dict, low: dict, s_k: int) -> dict:
    """check_close on every tensor the reference produced: 2x for out/LSE, 3x for gradients."""
    report = {}
    for name in ("out", "lse", *GRAD_NAMES):
        if name in high and name in kernel:
            factor = 3.0 if name.startswith("d") else 2.0
            atol = lse_atol(high[name], s_k) if name == "lse" else None
            report[name] = check_close(
                name, kernel[name], high[name], low[name], factor=factor, atol=atol
            )
    return report


def summarize(path: str) -> str:
    """A plain-text table from the JSON lines the GPU suite appends to FUSEDLAYERS_GPU_SUMMARY
    (usage: `python tests/attention_testing.py PATH`)."""
    entries = [json.loads(line) for line in open(path)]
    lines = [f"{len(entries)} cases: " + ", ".join(
        f"{sum(e['status'] == s for e in entries)} {s}" for s in ("pass", "fail", "skip")
    )]  # fmt: skip
    for e in sorted(entries, key=lambda e: (e["status"] != "fail", e["test"])):
        errs = " ".join(
            f"{n}={r['error']:.1e}" + (f"/{r['pytorch_error']:.1e}" if "pytorch_error" in r else "")
            for n, r in e["errors"].items()
        )
        lines.append(f"{e['status']:4} {e['seconds']:7.1f}s {e['test']} [{e['case']}] {errs}")
        if e["status"] == "fail":
            lines.append("     " + e.get("message", "").replace("\n", " ")[:400])
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
