"""Norm benchmark: the fused Triton LayerNorm / RMSNorm against the torch paths it replaces.

Providers, all on the same data in one process:
    fusedlayers    fusedlayers.kernels.layer_norm (what the modules run on CUDA from
                   normalization.KERNEL_MIN_HIDDEN)
    torch-fp32     the fp32-upcast torch path (`normalization_reference`: what they run below it)
    torch-native   plain F.layer_norm / F.rms_norm in the input dtype
    compiled-fp32  torch.compile of the fp32-upcast path

Each (norm, pass, hidden) case is checked first: every provider's output (and dx, dweight, dbias
for fwdbwd) against an fp32 reference, by relative error; a provider that fails or raises is
reported, never timed.

    python examples/perf/benchmark_norm.py --out bench/norm   # < 2 min on an H100
    python examples/perf/benchmark_norm.py --dry-run          # tiny CPU run (Triton interpreter)

Prints a markdown table (ms, GB/s, speedup of fusedlayers over each provider) and writes it to
--out/norm.md when given.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:  # must precede any triton.jit decoration (fusedlayers.kernels import)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# bench_utils and benchmark_attention live one folder up, in examples/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_utils import (  # noqa: E402
    bench_ms,
    benchmark_device,
    configure_dynamo,
    csv_arg,
    device_label,
    git_describe,
    ints_arg,
    rel_err,
    write_table,
)
from fusedlayers.kernels import layer_norm  # noqa: E402

from fusedlayers.layers.normalization import normalization_reference  # noqa: E402

NORMS = ("LayerNorm", "RMSNorm")
PASSES = ("fwd", "fwdbwd")
PROVIDERS = ("fusedlayers", "torch-fp32", "torch-native", "compiled-fp32")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-5
# Relative-error ceiling per input dtype: a few units of its rounding on a norm-wide measure.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def providers(norm: str, compile_backend: str) -> dict[str, Fn]:
    """name -> fn(x, weight, bias) for one norm type; bias is None for RMSNorm."""
    rms = norm == "RMSNorm"

    def fused(x, w, b):
        return layer_norm(x, w, b, EPS, rms=rms, zero_centered_gamma=False)

    def fp32(x, w, b):
        return normalization_reference(x, w, b, EPS, norm)

    def native(x, w, b):
        shape = (x.shape[-1],)
        return F.rms_norm(x, shape, w, EPS) if rms else F.layer_norm(x, shape, w, b, EPS)

    return {
        "fusedlayers": fused,
        "torch-fp32": fp32,
        "torch-native": native,
        # Static shapes, as a model compiles: each hidden size gets its own specialized kernels.
        "compiled-fp32": torch.compile(fp32, backend=compile_backend, dynamic=False),
    }


def make_inputs(rows: int, hidden: int, norm: str, dtype: torch.dtype, device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(hidden)
    make = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    return dict(
        x=(make(rows, hidden) * 2 + 0.5).to(dtype).requires_grad_(),
        weight=(make(hidden) * 0.5 + 1).to(dtype).requires_grad_(),
        bias=(make(hidden) * 0.5).to(dtype).requires_grad_() if norm == "LayerNorm" else None,
        dy=make(rows, hidden).to(dtype),
    )


def leaves(inputs: dict) -> list[torch.Tensor]:
    return [inputs[name] for name in ("x", "weight", "bias") if inputs[name] is not None]


def job(fn: Fn, inputs: dict, pass_: str) -> Callable[[], object]:
    """The timed closure: forward, or forward + backward of dy (autograd.grad: no accumulation)."""
    x, w, b, dy = inputs["x"], inputs["weight"], inputs["bias"], inputs["dy"]
    if pass_ == "fwd":
        return lambda: fn(x, w, b)
    return lambda: torch.autograd.grad(fn(x, w, b), leaves(inputs), dy)


def results(fn: Fn, inputs: dict, pass_: str) -> list[torch.Tensor]:
    """[y] for fwd; [y, dx, dweight(, dbias)] for fwdbwd."""
    y = fn(inputs["x"], inputs["weight"], inputs["bias"])
    if pass_ == "fwd":
        return [y.detach()]
    return [y.detach(), *torch.autograd.grad(y, leaves(inputs), inputs["dy"])]


def reference(inputs: dict, norm: str, pass_: str) -> list[torch.Tensor]:
    """The same results with every tensor in fp32 (the check's yardstick)."""
    as32 = {
        k: None if t is None else t.detach().float().requires_grad_() for k, t in inputs.items()
    }
    as32["dy"] = as32["dy"].detach()
    return results(lambda x, w, b: normalization_reference(x, w, b, EPS, norm), as32, pass_)


def useful_bytes(rows: int, hidden: int, dtype: torch.dtype, pass_: str) -> float:
    """Minimal traffic of the job: fwd reads x, writes y; the backward reads x, dy and writes dx
    (parameters and per-row statistics are noise at these sizes). The same count for every
    provider, so GB/s is effective bandwidth and ratios equal time ratios."""
    tensors = 2 if pass_ == "fwd" else 5
    return tensors * rows * hidden * dtype.itemsize


def time_ms(fn: Callable[[], object], dry_run: bool, warmup: int, rep: int) -> float:
    if not dry_run:
        return bench_ms(fn, warmup, rep)
    start = time.perf_counter()  # CPU stand-in for do_bench: one run after one warm-up
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run_case(fns: dict[str, Fn], inputs: dict, norm: str, pass_: str, args) -> dict[str, dict]:
    """provider -> {ms, gbs} or {error}: checked against the fp32 reference, then timed."""
    expected = reference(inputs, norm, pass_)
    tol = TOLERANCE[inputs["x"].dtype]
    rows, hidden = inputs["x"].shape
    cells: dict[str, dict] = {}
    for name in args.providers:
        try:
            got = results(fns[name], inputs, pass_)
            err = max(rel_err(a, e) for a, e in zip(got, expected))
            if err > tol:
                cells[name] = {"error": f"FAIL rel err {err:.1e} > {tol:.0e}"}
                continue
            ms = time_ms(job(fns[name], inputs, pass_), args.dry_run, args.warmup, args.rep)
        except Exception as error:  # report and go on: one broken provider must not stop the rest
            cells[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"}
            continue
        gbs = useful_bytes(rows, hidden, inputs["x"].dtype, pass_) / (ms * 1e-3) / 1e9
        cells[name] = {"ms": ms, "gbs": gbs, "rel_err": err}
    return cells


def markdown(rows: list[dict], args, header: str) -> str:
    others = [p for p in args.providers if p != "fusedlayers"]
    cols = ["norm", "pass", "hidden", *args.providers]
    if "fusedlayers" in args.providers:
        cols += [f"vs {p}" for p in others]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = [row["norm"], row["pass"], str(row["hidden"])]
        for p in args.providers:
            c = row["cells"][p]
            cells.append(c["error"] if "error" in c else f"{c['ms']:.3f} ms ({c['gbs']:.0f} GB/s)")
        if "fusedlayers" in args.providers:
            ours = row["cells"]["fusedlayers"]
            for p in others:
                c = row["cells"][p]
                ok = "ms" in ours and "ms" in c
                cells.append(f"{c['ms'] / ours['ms']:.2f}x" if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--hidden", type=ints_arg, default=[1024, 2048, 4096, 8192])
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--norms", type=csv_arg(NORMS), default=list(NORMS))
    p.add_argument("--passes", type=csv_arg(PASSES), default=list(PASSES))
    p.add_argument("--providers", type=csv_arg(PROVIDERS), default=list(PROVIDERS))
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--out", type=Path, default=None, help="directory for norm.md")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on the CPU (Triton interpreter, aot_eager compile, wall-clock timer): "
        "checks the pipeline, measures nothing",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.rows, args.hidden = 64, [32, 48]
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    device = benchmark_device(args.dry_run)
    configure_dynamo()
    dtype = DTYPES[args.dtype]
    started = time.perf_counter()
    rows = []
    for norm in args.norms:
        fns = providers(norm, "aot_eager" if args.dry_run else "inductor")
        for hidden in args.hidden:
            inputs = make_inputs(args.rows, hidden, norm, dtype, device)
            for pass_ in args.passes:
                cells = run_case(fns, inputs, norm, pass_, args)
                rows.append({"norm": norm, "pass": pass_, "hidden": hidden, "cells": cells})
                print(
                    f"[{time.perf_counter() - started:5.1f}s] {norm} {pass_} {hidden}", flush=True
                )
    gpu = device_label(device)
    header = (
        f"## Norms: {args.dtype}, rows {args.rows} ({gpu}; torch {torch.__version__}; "
        f"fusedlayers git {git_describe()})\n\n"
        "Cells: median ms of triton.testing.do_bench (L2 flushed) and effective GB/s over the "
        "minimal traffic (fwd: x + y; fwdbwd: x + y + x + dy + dx). `vs X` = time of X / time of "
        "fusedlayers (> 1: fusedlayers faster). Inputs require grad in both passes; fwdbwd = "
        "forward + autograd.grad of a random dy for x, weight (and bias)."
    )
    table = markdown(rows, args, header)
    write_table(table, args.out, "norm.md")
    return table


if __name__ == "__main__":
    main()
