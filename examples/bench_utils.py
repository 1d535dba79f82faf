"""Measuring helpers for the attention benchmark: FLOP counts, timing, memory, result writers.

Everything here imports on a CPU-only machine: torch.cuda, triton and matplotlib are touched only
inside the functions that measure or draw, so the FLOP counts and writers are testable anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Forward + backward is counted as 3.5x the forward (flash-attention papers: the backward does
# 2.5x the forward's matmul work, five matmuls against two).
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


def attention_flops(
    b: int,
    h: int,
    s_q: int,
    s_k: int,
    d: int,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    pass_: str = "fwd",
) -> float:
    """FLOPs of one attention call as the papers count them, on query heads.

    Forward: two matmuls of 2*d FLOPs per visible (query, key) pair, i.e. 4*b*h*s_q*s_k*d dense.
    Square causal uses the papers' convention (exactly half, as anchors.md does) so our numbers
    line up with published ones; any other mask (windows, causal with s_q != s_k) counts the
    visible pairs exactly, since "half" would be wrong there.
    """
    if window is None:
        window = (-1, 0) if causal else (-1, -1)
    if window == (-1, -1):
        pairs: float = s_q * s_k
    elif window == (-1, 0) and s_q == s_k:
        pairs = s_q * s_k / 2
    else:
        pairs = visible_pairs(s_q, s_k, window)
    return 4.0 * b * h * d * pairs * PASS_FACTOR[pass_]


def benchmark_device(dry_run: bool) -> str:
    """ "cuda", or "cpu" for a --dry-run pipeline check; exits when CUDA is wanted but absent."""
    if dry_run:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run for the CPU pipeline check)")
    return "cuda"


def device_label(device: str) -> str:
    """The GPU's name for a table header, or a warning that a dry run measured nothing."""
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "CPU dry run (not a measurement)"


def write_table(table: str, out_dir: Path | None, name: str) -> None:
    """Print a markdown table and, with `out_dir`, write it there as `name`."""
    print(table)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(table)
        print(f"wrote {out_dir / name}")


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


def matmul_ceiling_tflops(warmup: int = 25, rep: int = 100) -> float:
    """bf16 8192^3 matmul rate in this process: the practical ceiling anchors.md quotes."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, warmup, rep)
    return 2 * n**3 / ms / 1e9


# ----------------------------------------------------------------------------- checking


@dataclass
class Runner:
    """One provider on one case: its call, its inputs, and how to read its result for the check."""

    name: str
    forward: Callable
    leaves: list
    dout: object
    flops: float  # forward FLOPs of the work this provider does (padding included)
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
        flops = runner.flops * PASS_FACTOR[pass_]
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


# ----------------------------------------------------------------------------- environment


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


def git_describe() -> str:
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


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


def environment_header(warmup: int, rep: int, tolerance: dict) -> dict:
    """Date, GPU, versions, exact command and the method, for the top of the report."""
    import torch
    import triton

    try:  # a broken fusedlayers import still lets the competitors be measured
        import fusedlayers

        version = f"{fusedlayers.__version__} (git {git_describe()})"
    except Exception as error:
        version = f"import failed: {short_error(error)}"
    now = datetime.datetime.now(datetime.timezone.utc)
    ceiling = matmul_ceiling_tflops(warmup, rep)
    return {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": f"{torch.cuda.get_device_name()} (bf16 8192^3 matmul: {ceiling:.0f} TFLOP/s)",
        "versions": f"torch {torch.__version__}, triton {triton.__version__}, "
        f"cuDNN {torch.backends.cudnn.version()}, python {sys.version.split()[0]}",
        "fusedlayers": version,
        "command": shlex.join(sys.orig_argv),
        "method": [
            f"time: triton.testing.do_bench median (warmup {warmup} ms, rep {rep} ms, "
            "L2 flushed before each run); inputs require grad in both passes; fwdbwd = forward "
            "+ backward of a random dout, grads set to None before each run",
            "cells: TFLOP/s, forward 4*b*h_q*s_q*s_k*d, halved for square causal; windows and "
            "varlen count visible pairs exactly; fwdbwd = 3.5x forward; each provider counts its "
            "own work",
            "subject/X = time of X / time of the subject for the same job (> 1: subject faster)",
            "mem MiB: peak max_memory_allocated over the live inputs for one call of the pass "
            "(grads included); MEM flag: subject > baseline + 10%",
            "checked once per shape (output, and dq/dk/dv when fwdbwd runs) against SDPA: "
            f"rel err over {tolerance} = WRONG, not timed",
        ],
    }


# ----------------------------------------------------------------------------- results


def tflops(flops: float, ms: float) -> float:
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


SHAPE_COLUMNS = {
    "sweep": ("dtype", "d", "s", "b", "h", "causal", "pass"),
    "gqa": ("dtype", "d", "s", "b", "h", "hkv", "causal", "pass"),
    "varlen": ("dtype", "d", "tokens", "seqs", "h", "causal", "pass"),
    "packed": ("dtype", "d", "s", "b", "h", "causal", "pass"),
    "window": ("dtype", "d", "s", "b", "h", "window", "pass"),
}
SECTION_TITLES = {
    "sweep": "Sweep: b = 16384/s, h = 2048/d",
    "gqa": "GQA (TFLOP/s on query heads)",
    "varlen": "Varlen thd (random lengths, 16k tokens)",
    "packed": "Packed sb3hd views vs contiguous sbhd (DotProductAttention)",
    "window": "Sliding window, causal",
}


def _shape_cell(row: dict, col: str) -> str:
    if col == "s":
        return str(row["s_q"])
    if col == "h":
        return str(row["hq"])
    if col == "causal":
        return "1" if row["causal"] else "0"
    if col == "window":
        return str(tuple(row["window"]))
    return str(row[col])


def _fmt(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def _provider_cell(p: dict | None, footnotes: dict[str, int]) -> str:
    if p is None:
        return ""
    if p["status"] == "ok":
        return _fmt(p["tflops"])
    if p["status"] == "wrong":
        return "WRONG"
    if p["status"] == "skipped":
        return "skip"
    key = p.get("error", "?")
    footnotes.setdefault(key, len(footnotes) + 1)
    return f"err[{footnotes[key]}]"


def section_markdown(rows: list[dict], kind: str) -> str:
    """One table: shape columns, TFLOP/s per provider, subject/competitor ratios, memory."""
    names: list[str] = []
    for row in rows:
        names += [n for n in row["providers"] if n not in names]
    subject = rows[0]["subject"]
    others = [n for n in names if n != subject]
    shape = SHAPE_COLUMNS[kind]
    head = [*shape, *names, *(f"{subject}/{n}" for n in others), "mem MiB (subj/base)", "flag"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    footnotes: dict[str, int] = {}
    for row in rows:
        cells = [_shape_cell(row, c) for c in shape]
        cells += [_provider_cell(row["providers"].get(n), footnotes) for n in names]
        cells += [f"{row['ratios'][n]:.2f}" if n in row["ratios"] else "" for n in others]
        mem = [row["providers"].get(n, {}).get("mem_mib") for n in (subject, row["mem_baseline"])]
        cells.append("/".join("-" if m is None else f"{m:.0f}" for m in mem))
        flags = (["MEM>base+10%"] if row["mem_flag"] else []) + (
            ["WRONG"] if any(p["status"] == "wrong" for p in row["providers"].values()) else []
        )
        cells.append(" ".join(flags))
        lines.append("| " + " | ".join(cells) + " |")
    notes = sorted({n for row in rows for n in row.get("notes", [])})
    lines += [""] + [f"- {n}" for n in notes]
    lines += [f"- err[{i}]: {msg}" for msg, i in footnotes.items()]
    return "\n".join(lines)


def header_markdown(header: dict) -> str:
    lines = ["# Attention benchmark", ""]
    lines += [f"- {key}: {value}" for key, value in header.items() if key != "method"]
    lines += [f"- {line}" for line in header.get("method", [])]
    return "\n".join(lines)


def results_markdown(header: dict, rows: list[dict]) -> str:
    parts = [header_markdown(header)]
    for kind, title in SECTION_TITLES.items():
        kind_rows = [r for r in rows if r["case"] == kind]
        for subject in dict.fromkeys(r["subject"] for r in kind_rows):
            sub = [r for r in kind_rows if r["subject"] == subject]
            parts.append(f"## {title}\n\n{section_markdown(sub, kind)}")
    return "\n\n".join(parts) + "\n"


def plot_sweep(rows: list[dict], path: str) -> str:
    """TFLOP/s vs s, one panel per (d, causal, pass); returns what happened, for the log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: attention.png skipped (pip install matplotlib)"
    sweep = [r for r in rows if r["case"] == "sweep"]
    panels = sorted({(r["d"], r["causal"], r["pass"]) for r in sweep})
    if not panels:
        return "no sweep rows: attention.png skipped"
    cols = min(4, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.6 * nrows), squeeze=False)
    styles = {"bf16": "-", "fp16": "--"}
    for ax, (d, causal, pass_) in zip(axes.flat, panels):
        here = [r for r in sweep if (r["d"], r["causal"], r["pass"]) == (d, causal, pass_)]
        series = {(n, r["dtype"]) for r in here for n in r["providers"]}
        for name, dtype in sorted(series):
            pts = sorted(
                (r["s_q"], r["providers"][name]["tflops"])
                for r in here
                if r["dtype"] == dtype and r["providers"].get(name, {}).get("status") == "ok"
            )
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, styles.get(dtype, ":"), marker="o", label=f"{name} {dtype}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d} causal={int(causal)} {pass_}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def write_results(out_dir: str, header: dict, rows: list[dict], plot: bool = True) -> str:
    """attention.json, attention.md (and attention.png); returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "attention.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    text = results_markdown(header, rows)
    with open(os.path.join(out_dir, "attention.md"), "w") as f:
        f.write(text)
    if plot:
        print(plot_sweep(rows, os.path.join(out_dir, "attention.png")))
    return text


def merge_results(dirs: Sequence[str]) -> tuple[dict, list[dict]]:
    """Join the attention.json of several runs (the full sweep split to fit the 10-minute limit).

    The header keeps the first run's fields and lists every run's command; rows keep their order.
    """
    header: dict = {}
    rows: list[dict] = []
    commands = []
    for d in dirs:
        with open(os.path.join(d, "attention.json")) as f:
            data = json.load(f)
        header = header or dict(data["header"])
        commands.append(data["header"].get("command", "?"))
        rows += data["rows"]
    header["command"] = " ; ".join(commands)
    return header, rows
