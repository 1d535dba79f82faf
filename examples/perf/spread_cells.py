"""The headline attention cells against cuDNN in one process, for reading the spread between
processes (and, within the process, between fresh inputs).

    for i in 1 2 3; do python examples/perf/spread_cells.py --json spread-$i.json; done
    python examples/perf/spread_cells.py --compare spread-1.json spread-2.json spread-3.json

bf16, b = 16384 / s, h = 2048 / d, causal and not, forward and forward+backward; inputs
[b, s, h, d] requiring grad as a training step has them, cuDNN (SDPA pinned) on their
[b, h, s, d] transposed views. Each of `--rounds` rounds draws fresh inputs, so the tensors'
addresses change between rounds as they do between processes, and times ours and cuDNN
interleaved (`triton.testing.do_bench` medians, L2 flushed before each run); the rounds go over
every cell in turn, after `--preheat` seconds of load (the GPU runs at its power cap and slows
as it heats, so a cell's reading depends on when in the process it is taken), and only if a bf16
matmul then still reaches `--min-matmul` TFLOP/s (a GPU that runs hot reads everything slow).
A cell prints the median over rounds per provider, the spread over rounds (max / min - 1) and
the ratio of the medians. `--compare` reads the JSON of several processes and prints each cell's
medians side by side with the spread between processes (max / min - 1), the number the stability
target bounds.
TFLOP/s count 4 b h s^2 d forward and 3.5x that forward+backward, halved when causal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlayers import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_utils import bench_ms, matmul_ceiling_tflops  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
PROVIDERS = ("ours", "cudnn")


def one_round(d: int, s: int, causal: bool, passes: list[str]) -> dict[str, float]:
    """Milliseconds per (provider/pass) on freshly drawn inputs."""
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (
        torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn_like(q)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    calls = {
        "ours": lambda: flash_attn_func(q, k, v, causal=causal),
        "cudnn": lambda: _cudnn(qt, kt, vt, causal),
    }
    times = {}
    for p in passes:
        for name in PROVIDERS:
            fn = calls[name]
            job = fn if p == "fwd" else (lambda fn=fn: fn().backward(dout))
            times[f"{name}/{p}"] = bench_ms(job, 25, 100, grad_to_none=[q, k, v])
    return times


def _cudnn(qt, kt, vt, causal: bool) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1


def summarize(d: int, s: int, causal: bool, per_round: list[dict[str, float]]) -> dict:
    """A cell's medians, per-round TFLOP/s and spread over rounds, from its rounds' times."""
    flops = 4 * (TOKENS // s) * (HIDDEN // d) * s * s * d / (2 if causal else 1)
    cell = {"d": d, "s": s, "causal": int(causal)}
    for key in per_round[0]:
        ms = [r[key] for r in per_round]
        work = flops * (3.5 if key.endswith("fwdbwd") else 1.0)
        cell[key] = {
            "tflops": work / statistics.median(ms) / 1e9,
            "rounds_tflops": [work / t / 1e9 for t in ms],
            "spread": spread(ms),
        }
    return cell


def preheat(seconds: float) -> None:
    """Run a d=128 s=16k forward+backward for `seconds`, so the GPU reaches the temperature and
    clocks it holds under sustained attention work before anything is timed: this H100 runs at
    its power cap and slows further when hot, which a cold process otherwise reads as speed."""
    q, k, v = (
        torch.randn(1, 16384, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            flash_attn_func(q, k, v).sum().backward()
        torch.cuda.synchronize()


def cell_name(cell: dict, p: str) -> str:
    return f"d={cell['d']} s={cell['s']} causal={cell['causal']} {p}"


def report(cell: dict, passes: list[str]) -> list[str]:
    lines = []
    for p in passes:
        ours, cudnn = cell[f"ours/{p}"], cell[f"cudnn/{p}"]
        lines.append(
            f"{cell_name(cell, p):<30} ours {ours['tflops']:4.0f} (rounds {ours['spread']:5.1%})"
            f"  cudnn {cudnn['tflops']:4.0f} (rounds {cudnn['spread']:5.1%})"
            f"  ratio {ours['tflops'] / cudnn['tflops']:.3f}"
        )
    return lines


def compare(paths: list[str], bound: float = 0.03) -> list[str]:
    """Per cell and provider: each process's median TFLOP/s and their spread."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    lines = [f"{len(runs)} processes; spread = max / min - 1 over the processes' medians"]
    matmuls = [run.get("matmul_tflops") for run in runs]
    if all(m is not None for m in matmuls):
        lines.append("bf16 matmul after the preheat: " + ", ".join(f"{m:.0f}" for m in matmuls))
    for i, cell in enumerate(runs[0]["cells"]):
        for p in runs[0]["passes"]:
            medians = {
                name: [run["cells"][i][f"{name}/{p}"]["tflops"] for run in runs]
                for name in PROVIDERS
            }
            parts = [
                f"{name} {', '.join(f'{v:.0f}' for v in values)} ({spread(values):.1%})"
                for name, values in medians.items()
            ]
            ratios = ", ".join(f"{o / c:.3f}" for o, c in zip(medians["ours"], medians["cudnn"]))
            flag = "" if spread(medians["ours"]) <= bound else f"  OVER {bound:.0%}"
            lines.append(
                f"{cell_name(cell, p):<30} " + "  ".join(parts) + f"  ratio {ratios}{flag}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--causal", default="0,1")
    parser.add_argument("--passes", default="fwd,fwdbwd")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--preheat", type=float, default=20.0, help="seconds of load first")
    parser.add_argument(
        "--min-matmul",
        type=float,
        default=550.0,
        help="TFLOP/s a bf16 8192^3 matmul must reach after the preheat, else nothing is timed "
        "(a throttled GPU; 0 turns the check off)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--compare", nargs="+", default=None, metavar="JSON")
    args = parser.parse_args()
    if args.compare:
        print("\n".join(compare(args.compare)))
        return
    passes = args.passes.split(",")
    print(
        torch.cuda.get_device_name(), torch.__version__, triton.__version__,
        f"cuDNN {torch.backends.cudnn.version()}", flush=True,
    )  # fmt: skip
    shapes = [
        (int(d), int(s), bool(int(c)))
        for d in args.dims.split(",")
        for s in args.seqlens.split(",")
        for c in args.causal.split(",")
    ]
    preheat(args.preheat)
    # A healthy H100 runs this matmul at 650-790 TFLOP/s warm; one that ran hot (idle at 59-72 C)
    # read 410 a second into load, and every attention cell at a quarter of its rate.
    matmul = matmul_ceiling_tflops()
    print(f"bf16 8192^3 matmul after the preheat: {matmul:.0f} TFLOP/s", flush=True)
    if matmul < args.min_matmul:
        raise SystemExit(
            f"the matmul ran at {matmul:.0f} TFLOP/s, under --min-matmul {args.min_matmul:.0f}: "
            "the GPU is throttled (hot or power-capped), so its readings would not compare"
        )
    # Round by round over every cell, so each cell's rounds sample the whole run's GPU state
    # rather than one stretch of it.
    times = {shape: [] for shape in shapes}
    for _ in range(args.rounds):
        for shape in shapes:
            times[shape].append(one_round(*shape, passes))
    cells = [summarize(*shape, rounds) for shape, rounds in times.items()]
    for cell in cells:
        print("\n".join(report(cell, passes)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"passes": passes, "matmul_tflops": matmul, "cells": cells}, f, indent=1)


if __name__ == "__main__":
    main()
