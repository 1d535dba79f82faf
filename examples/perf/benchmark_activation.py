"""Activation benchmark: the fused Triton MLP activations against the PyTorch path they replace.

Providers, all on the same data in one process:
    fusedlayers  apply_activation(backend="kernel"): one kernel forward, one backward
    torch        apply_activation(backend="reference"): chunk + activation + mul as torch ops
    compiled     torch.compile of that PyTorch path (inductor; not run by default)

Each (activation, pass, n) case is checked first: every provider's y (and dx for fwdbwd) against
an fp32 run of the PyTorch path, by relative error; a provider that fails or raises is reported,
never timed. x is [rows, 2n] for gated activations and [rows, n] for plain ones; y is [rows, n].

    python examples/perf/benchmark_activation.py --out bench/activation  # < 1 min on an H100
    python examples/perf/benchmark_activation.py --dry-run               # tiny CPU run

Prints a markdown table (median ms of triton.testing.do_bench, GB/s, speedup of fusedlayers) and
writes it to --out/activation.md when given.
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
from bench_utils import (  # noqa: E402
    bench_ms,
    benchmark_device,
    csv_arg,
    device_label,
    git_describe,
    ints_arg,
    rel_err,
    write_table,
)

from fusedlayers.layers.mlp import (  # noqa: E402
    ACTIVATIONS,
    activation_reference,
    apply_activation,
    is_gated,
)

PASSES = ("fwd", "fwdbwd")
PROVIDERS = ("fusedlayers", "torch", "compiled")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative-error ceiling per input dtype: a few units of its rounding on a tensor-wide measure.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}

Fn = Callable[[torch.Tensor], torch.Tensor]


def providers(activation: str, names: list[str], compile_backend: str) -> dict[str, Fn]:
    """name -> fn(x) for one activation (only the asked-for ones: compiling costs seconds)."""
    made: dict[str, Fn] = {
        "fusedlayers": lambda x: apply_activation(x, activation, backend="kernel"),
        "torch": lambda x: apply_activation(x, activation, backend="reference"),
    }
    if "compiled" in names:
        made["compiled"] = torch.compile(
            lambda x: activation_reference(x, activation), backend=compile_backend, dynamic=False
        )
    return made


def make_inputs(rows: int, n: int, activation: str, dtype: torch.dtype, device: str) -> dict:
    """x [rows, 2n or n] (requires grad, as FC1's output does in training), dy [rows, n]."""
    g = torch.Generator(device=device).manual_seed(n)
    width = 2 * n if is_gated(activation) else n
    x = torch.randn(rows, width, generator=g, device=device) * 2
    dy = torch.randn(rows, n, generator=g, device=device)
    return dict(x=x.to(dtype).requires_grad_(), dy=dy.to(dtype))


def job(fn: Fn, inputs: dict, pass_: str) -> Callable[[], object]:
    """The timed closure: forward, or forward + backward of dy (autograd.grad: no accumulation)."""
    x, dy = inputs["x"], inputs["dy"]
    if pass_ == "fwd":
        return lambda: fn(x)
    return lambda: torch.autograd.grad(fn(x), x, dy)


def results(fn: Fn, x: torch.Tensor, dy: torch.Tensor, pass_: str) -> list[torch.Tensor]:
    """[y] for fwd; [y, dx] for fwdbwd."""
    y = fn(x)
    if pass_ == "fwd":
        return [y.detach()]
    return [y.detach(), *torch.autograd.grad(y, x, dy)]


def reference(inputs: dict, activation: str, pass_: str) -> list[torch.Tensor]:
    """The PyTorch path on fp32 copies (the check's yardstick)."""
    x = inputs["x"].detach().float().requires_grad_()
    fn = lambda t: activation_reference(t, activation)  # noqa: E731
    return results(fn, x, inputs["dy"].float(), pass_)


def useful_bytes(rows: int, n: int, activation: str, dtype: torch.dtype, pass_: str) -> float:
    """Minimal traffic, the same for every provider: fwd reads x and writes y; the backward reads
    x and dy and writes dx. Gated x and dx are [rows, 2n], the rest [rows, n]."""
    wide = 2 if is_gated(activation) else 1
    per_row = wide + 1 if pass_ == "fwd" else (wide + 1) + (2 * wide + 1)
    return per_row * rows * n * dtype.itemsize


def time_ms(fn: Callable[[], object], dry_run: bool, warmup: int, rep: int) -> float:
    if not dry_run:
        return bench_ms(fn, warmup, rep)
    fn()  # CPU stand-in for do_bench: one run after one warm-up
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run_case(fns: dict[str, Fn], inputs: dict, activation: str, pass_: str, args) -> dict:
    """provider -> {ms, gbs, rel_err} or {error}: checked against fp32, then timed."""
    expected = reference(inputs, activation, pass_)
    tol = TOLERANCE[inputs["x"].dtype]
    rows, n = inputs["dy"].shape
    cells: dict[str, dict] = {}
    for name in args.providers:
        try:
            got = results(fns[name], inputs["x"], inputs["dy"], pass_)
            err = max(rel_err(a, e) for a, e in zip(got, expected))
            if err > tol:
                cells[name] = {"error": f"FAIL rel err {err:.1e} > {tol:.0e}"}
                continue
            ms = time_ms(job(fns[name], inputs, pass_), args.dry_run, args.warmup, args.rep)
        except Exception as error:  # report and go on: one broken provider must not stop the rest
            cells[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"}
            continue
        gbs = useful_bytes(rows, n, activation, inputs["x"].dtype, pass_) / (ms * 1e-3) / 1e9
        cells[name] = {"ms": ms, "gbs": gbs, "rel_err": err}
    return cells


def markdown(rows: list[dict], args, header: str) -> str:
    # Speedup columns compare every other provider with fusedlayers, when fusedlayers ran.
    others = [p for p in args.providers if p != "fusedlayers"]
    speedups = others if "fusedlayers" in args.providers else []
    cols = ["activation", "pass", "x", *args.providers, *(f"vs {p}" for p in speedups)]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = [row["activation"], row["pass"], row["x"]]
        for p in args.providers:
            c = row["cells"][p]
            cells.append(c["error"] if "error" in c else f"{c['ms']:.3f} ms ({c['gbs']:.0f} GB/s)")
        for p in speedups:
            mine, theirs = row["cells"]["fusedlayers"], row["cells"][p]
            both = "ms" in mine and "ms" in theirs
            cells.append(f"{theirs['ms'] / mine['ms']:.2f}x" if both else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--n", type=ints_arg, default=[2048], help="output widths (gated x: 2n)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--activations", type=csv_arg(ACTIVATIONS), default=["swiglu", "gelu"])
    p.add_argument("--passes", type=csv_arg(PASSES), default=list(PASSES))
    p.add_argument("--providers", type=csv_arg(PROVIDERS), default=["fusedlayers", "torch"])
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--out", type=Path, default=None, help="directory for activation.md")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on the CPU (Triton interpreter, aot_eager compile, wall-clock timer): "
        "checks the pipeline, measures nothing",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.rows, args.n = 64, [40]
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    device = benchmark_device(args.dry_run)
    dtype = DTYPES[args.dtype]
    started = time.perf_counter()
    rows = []
    for activation in args.activations:
        fns = providers(activation, args.providers, "aot_eager" if args.dry_run else "inductor")
        for n in args.n:
            inputs = make_inputs(args.rows, n, activation, dtype, device)
            shape = "x".join(map(str, inputs["x"].shape))
            for pass_ in args.passes:
                cells = run_case(fns, inputs, activation, pass_, args)
                rows.append({"activation": activation, "pass": pass_, "x": shape, "cells": cells})
                elapsed = time.perf_counter() - started
                print(f"[{elapsed:5.1f}s] {activation} {pass_} {shape}", flush=True)
    gpu = device_label(device)
    header = (
        f"## MLP activations: {args.dtype}, rows {args.rows} ({gpu}; torch {torch.__version__}; "
        f"fusedlayers git {git_describe()})\n\n"
        "Cells: median ms of triton.testing.do_bench (L2 flushed) and effective GB/s over the "
        "minimal traffic (fwd: x + y; fwdbwd: x + y + x + dy + dx). `vs X` = time of X / time of "
        "fusedlayers (> 1: fusedlayers faster). x requires grad in both passes; fwdbwd = forward "
        "+ autograd.grad of a random dy."
    )
    table = markdown(rows, args, header)
    write_table(table, args.out, "activation.md")
    return table


if __name__ == "__main__":
    main()
