"""Measuring helpers of the benchmarks: FLOP counts, timing, memory, the correctness check.

Everything here imports on a CPU-only machine: torch.cuda and triton are touched only inside the
functions that measure, so the FLOP counts and the ratio arithmetic are testable anywhere. The
attention benchmark uses all of it; the other scripts take `bench_ms`, the argument types and
`short_error`.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Forward + backward is counted as 3.5x the forward (flash-attention papers: the backward does
# 2.5x the forward's matmul work, five matmuls against two) when q, k and v share a head dim;
# `pass_factor` gives the factor for any (d_qk, d_v).
PASS_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5}
# A provider whose peak memory exceeds the baseline's by more than this is flagged.
MEM_SLACK = 1.10
MIB = 2**20


def visible_pairs(s_q: int, s_k: int, window: tuple[int, int], bottom_right: bool = True) -> int:
    """Exact number of (query, key) pairs a window lets through (docs/internals.md's rule).

    Query i sees key j iff i + off - left <= j <= i + off + right, -1 = unbounded, off = s_k - s_q
    when bottom-right aligned else 0. One bounded range per query, so a loop over queries is exact.
    """
    left, right = window
    off = s_k - s_q if bottom_right else 0
    total = 0
    for i in range(s_q):
        lo = 0 if left < 0 else max(0, i + off - left)
        hi = s_k - 1 if right < 0 else min(s_k - 1, i + off + right)
        total += max(0, hi - lo + 1)
    return total


def pass_factor(pass_: str, d_qk: int, d_v: int) -> float:
    """FLOPs of `pass_` over the forward's, counting the matmuls by the head dim they contract.

    Forward: S = QK^T (d_qk) and O = PV (d_v). Backward: S again (d_qk), dP = dO V^T (d_v),
    dV = P^T dO (d_v), dQ = dS K (d_qk), dK = dS^T Q (d_qk). With d_v == d_qk that is
    1 + 10/4 = 3.5, PASS_FACTOR's factor, exactly.
    """
    if pass_ == "fwd":
        return 1.0
    if pass_ != "fwdbwd":
        raise KeyError(pass_)
    return 1.0 + (3 * d_qk + 2 * d_v) / (d_qk + d_v)


def attention_flops(
    b: int,
    h: int,
    s_q: int,
    s_k: int,
    d: int,
    *,
    d_v: int | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    pass_: str = "fwd",
) -> float:
    """FLOPs of one attention call as the papers count them, on query heads.

    Forward: 2*d FLOPs per visible (query, key) pair for QK^T and 2*d_v for PV (d_v defaults
    to d), i.e. 2*b*h*s_q*s_k*(d + d_v) dense, 4*b*h*s_q*s_k*d when d_v == d. Square causal
    uses the papers' convention (exactly half, as anchors.md does) so our numbers line up with
    published ones; any other mask (windows, causal with s_q != s_k) counts the visible pairs
    exactly, since "half" would be wrong there. fwdbwd: `pass_factor` times the forward.
    """
    d_v = d if d_v is None else d_v
    if window is None:
        window = (-1, 0) if causal else (-1, -1)
    if window == (-1, -1):
        pairs: float = s_q * s_k
    elif window == (-1, 0) and s_q == s_k:
        pairs = s_q * s_k / 2
    else:
        pairs = visible_pairs(s_q, s_k, window)
    return 2.0 * b * h * (d + d_v) * pairs * pass_factor(pass_, d, d_v)


def attention_work(b: int, h: int, s_q: int, s_k: int, d: int, **kwargs) -> dict[str, float]:
    """{pass: FLOPs} of one attention call for every pass (`attention_flops`' arguments)."""
    return {p: attention_flops(b, h, s_q, s_k, d, pass_=p, **kwargs) for p in PASS_FACTOR}


def total_work(works) -> dict[str, float]:
    """The sum of several `attention_work`s, per pass."""
    works = list(works)
    return {p: sum(w[p] for w in works) for p in PASS_FACTOR}


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in fp32; NaN or inf anywhere reads as inf so it can never pass."""
    x, ref = x.float(), ref.float()
    err = ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if err == err and err != float("inf") else float("inf")


def bench_ms(fn: Callable[[], object], warmup: int, rep: int, grad_to_none=None) -> float:
    """Median milliseconds of `fn` (triton's do_bench: CUDA events, L2 flushed before each run)."""
    from triton.testing import do_bench

    return float(
        do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    )


def peak_extra_mib(fn: Callable[[], object], leaves: Sequence) -> float:
    """Peak memory one call of `fn` allocates beyond what is live before it (inputs, dout).

    Gradients are dropped first so that a previous call's grads are not counted as inputs; the
    grads this call creates are counted, as they are for every provider.
    """
    import torch

    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in leaves:
        t.grad = None
    return peak / MIB


# ----------------------------------------------------------------------------- checking


@dataclass
class Runner:
    """One provider on one case: its call, its inputs, and how to read its result for the check."""

    name: str
    forward: Callable
    leaves: list
    dout: object
    flops: dict[str, float]  # {pass: FLOPs} of the work this provider does (padding included)
    canon: Callable  # (out, grads) -> (out, [dq, dk, dv]) in the layout of its reference
    ref: str = "main"
    note: str = ""


@dataclass
class Reference:
    out: object
    grads: list | None
    name: str


class FatalCudaError(RuntimeError):
    """The CUDA context is gone (illegal access, device assert): nothing after it can be trusted."""


def short_error(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:240]


def failure(error: BaseException) -> dict:
    """A provider failure as a result entry; FatalCudaError if the CUDA context did not survive."""
    import torch

    if isinstance(error, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
    try:
        torch.cuda.synchronize()
    except RuntimeError as fatal:
        raise FatalCudaError(f"{short_error(error)} (then: {short_error(fatal)})") from error
    return {"status": "error", "error": short_error(error)}


class Unsupported(RuntimeError):
    """A provider has no kernel for a case (a head dim, d_v != d_qk): reported, never timed."""


# What SDPA raises when the backend it is pinned to has no kernel for the call (the reasons
# come as warnings before it).
SDPA_REFUSALS = ("No available kernel", "No viable backend")


def unsupported(error: Unsupported) -> dict:
    """An unsupported provider as a result entry, with its reason."""
    return {"status": "unsupported", "error": str(error)[:240]}


def check_runner(runner: Runner, ref: Reference) -> tuple[dict[str, float], Exception | None]:
    """Norm-wise relative errors of the output (and dq, dk, dv) against the reference.

    A backward that raises is returned, not raised: the forward can still be measured (some
    backends support a head dim forward only).
    """
    out = runner.forward()
    grads, backward_error = None, None
    if ref.grads is not None:
        try:
            out.backward(runner.dout)
            grads = [t.grad for t in runner.leaves]
        except Exception as error:  # reported on the fwdbwd row
            backward_error = error
    out, grads = runner.canon(out.detach(), grads)
    errors = {"out": rel_err(out, ref.out)}
    if grads is not None:
        errors |= {n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref.grads)}
    for t in runner.leaves:
        t.grad = None
    return errors, backward_error


def measure_runner(runner: Runner, ref: Reference, tol: float, args) -> dict[str, dict]:
    """Check once, then peak memory and median time of each pass: {pass: result entry}.

    A pass whose checked values exceed `tol` (the output for fwd; output and grads for fwdbwd)
    is reported WRONG and not timed: a fast wrong answer is no result.
    """
    errors, backward_error = check_runner(runner, ref)
    results = {}
    for pass_ in args.passes:
        checked = {n: e for n, e in errors.items() if pass_ == "fwdbwd" or n == "out"}
        if any(e > tol for e in checked.values()):
            shown = ", ".join(f"{n} {e:.1e}" for n, e in checked.items())
            results[pass_] = {
                "status": "wrong",
                "relerr": errors,
                "error": f"rel err vs {ref.name}: {shown}",
            }
            continue
        fn = runner.forward
        if pass_ == "fwdbwd":
            if backward_error is not None:
                results[pass_] = failure(backward_error)
                continue
            fn = lambda: runner.forward().backward(runner.dout)
        try:
            mem = peak_extra_mib(fn, runner.leaves)
            ms = bench_ms(fn, args.warmup, args.rep, grad_to_none=runner.leaves)
        except Exception as error:  # any provider failure becomes a table entry, never a crash
            results[pass_] = failure(error)
            continue
        flops = runner.flops[pass_]
        results[pass_] = {
            "status": "ok",
            "ms": ms,
            "flops": flops,
            "tflops": tflops(flops, ms),
            "mem_mib": mem,
            "relerr": errors,
        }
    return results


def progress_lines(label: str, rows: list[dict], elapsed: float) -> list[str]:
    """A case's label with the elapsed time, then one line per pass: every provider's TFLOP/s,
    memory and worst relative error, or why it has none."""
    lines = [f"[{elapsed:5.0f}s] {label}"]
    for row in rows:
        cells = []
        for name, p in row["providers"].items():
            if p["status"] == "ok":
                err = max(p["relerr"].values())
                cells.append(f"{name} {p['tflops']:.0f} TF/s {p['mem_mib']:.0f} MiB err {err:.0e}")
            else:
                cells.append(f"{name} {p['status'].upper()}: {p.get('error', '')}")
        lines.append(f"    {row['pass']:6s} " + " | ".join(cells))
    return lines


# ----------------------------------------------------------------------------- arguments


def csv_arg(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated subset of `choices`."""

    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in items if x not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"{unknown or text!r}: choose from {list(choices)}")
        return items

    return parse


def ints_arg(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated ints") from error


def head_dims_arg(text: str) -> list[tuple[int, int]]:
    """argparse type: comma-separated head dims, each `A` (d_qk = d_v = A) or `AxB` (d_qk A,
    d_v B): "64,192x128" -> [(64, 64), (192, 128)]."""
    dims = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.lower().split("x")  # "128" -> d_v = d_qk; "192x128" -> d_v 128
        try:
            numbers = [int(part) for part in parts]
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{item!r}: expected D or DQKxDV") from error
        if len(numbers) > 2 or min(numbers) <= 0:
            raise argparse.ArgumentTypeError(f"{item!r}: expected positive D or DQKxDV")
        dims.append((numbers[0], numbers[-1]))
    if not dims:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated head dims")
    return dims


def configure_dynamo() -> None:
    """FlexAttention with dynamic=False compiles once per shape: lift Dynamo's recompile limits
    (8 by default) so later shapes are compiled too instead of falling back (anchors.md)."""
    import torch._dynamo.config as dynamo_config

    for name, value in (
        ("recompile_limit", 1024),
        ("cache_size_limit", 1024),
        ("accumulated_recompile_limit", 8192),
        ("accumulated_cache_size_limit", 8192),
    ):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, value)


def random_lengths(total: int, rng: random.Random, lo: int = 128, hi: int = 4096) -> list[int]:
    """Random sequence lengths summing to `total`; the last one is whatever remains."""
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(lo, hi), total - sum(lengths)))
    return lengths


# ----------------------------------------------------------------------------- results


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of `flops` done in `ms` milliseconds."""
    return flops / ms / 1e9


def finish_row(row: dict) -> dict:
    """Add ratios and the memory flag to a row whose providers are measured.

    ratio[X] = time of X / time of the subject for the same job (> 1: the subject is faster).
    It equals the TFLOP/s ratio when both count the same work, and stays meaningful when a
    competitor does more work (padding, a dense batch) for the same tokens.
    """
    provs = row["providers"]
    subject = provs.get(row["subject"], {})
    row["ratios"] = {}
    if subject.get("status") == "ok":
        for name, p in provs.items():
            if name != row["subject"] and p.get("status") == "ok":
                row["ratios"][name] = p["ms"] / subject["ms"]
    base = provs.get(row.get("mem_baseline") or "", {})
    row["mem_flag"] = bool(
        subject.get("mem_mib") is not None
        and base.get("mem_mib") is not None
        and subject["mem_mib"] > MEM_SLACK * base["mem_mib"]
    )
    return row
