"""RoPE benchmark: the fused Triton kernel against the PyTorch path it replaces.

The input is what MultiheadAttention hands RoPE: q as a head slice of the fused QKV projection
output, `[b, s, h + 2*hg, d]` (bshd) or `[s, b, h + 2*hg, d]` (sbhd), a strided view that neither
path copies. Providers, on the same data in one process:
    kernel      apply_rotary_pos_emb(..., backend="kernel"): the fused Triton kernel
    reference   apply_rotary_pos_emb(..., backend="reference"): the PyTorch path (fp32 math)

Each (format, pass) case first checks the kernel's output (and dq for fwdbwd) against the
reference run on an fp32 copy of the input, by relative error; a failing case is reported, not
timed.

    python examples/perf/benchmark_rope.py             # GPT-125M: b=8, s=2048, h=12, d=64, bf16
    python examples/perf/benchmark_rope.py --heads 32 --head-dim 128 --batch 2 --seqlen 8192
    python examples/perf/benchmark_rope.py --dry-run   # tiny CPU run (Triton interpreter)

Prints a markdown table: median ms (triton.testing.do_bench), effective GB/s over the minimal
traffic, and the kernel's speedup over the reference.
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
    rel_err,
    write_table,
)

from fusedlayers.layers.rope import RotaryPositionEmbedding, apply_rotary_pos_emb  # noqa: E402

FORMATS = ("bshd", "sbhd")
PASSES = ("fwd", "fwdbwd")
PROVIDERS = ("kernel", "reference")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative-error ceiling per input dtype: a few units of its rounding, tensor-wide.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def make_inputs(args, fmt: str, device: str) -> dict:
    """q (a strided head slice of a fused QKV tensor, a leaf that requires grad), freqs, dy."""
    g = torch.Generator(device=device).manual_seed(0)
    groups = args.gqa_groups or args.heads
    lead = (args.batch, args.seqlen) if fmt == "bshd" else (args.seqlen, args.batch)
    shape = (*lead, args.heads + 2 * groups, args.head_dim)
    fused = torch.randn(shape, generator=g, device=device, dtype=DTYPES[args.dtype])
    q = fused[..., : args.heads, :].detach().requires_grad_()  # a view: the fused strides
    rope = RotaryPositionEmbedding(
        args.head_dim, rotary_percent=args.rotary_percent, interleaved=args.interleaved
    )
    freqs = rope.to(device)(args.seqlen)
    dy = torch.randn(q.shape, generator=g, device=device, dtype=q.dtype)
    return dict(q=q, freqs=freqs, dy=dy)


def rotate_fn(provider: str, fmt: str, args) -> Callable[[torch.Tensor, torch.Tensor], object]:
    def fn(q, freqs):
        return apply_rotary_pos_emb(q, freqs, fmt, interleaved=args.interleaved, backend=provider)

    return fn


def results(fn, inputs: dict, pass_: str) -> list[torch.Tensor]:
    """[out] for fwd; [out, dq] for fwdbwd."""
    out = fn(inputs["q"], inputs["freqs"])
    if pass_ == "fwd":
        return [out.detach()]
    return [out.detach(), *torch.autograd.grad(out, inputs["q"], inputs["dy"])]


def job(fn, inputs: dict, pass_: str) -> Callable[[], object]:
    """The timed closure: forward, or forward + backward of dy (autograd.grad: no accumulation)."""
    q, freqs, dy = inputs["q"], inputs["freqs"], inputs["dy"]
    if pass_ == "fwd":
        return lambda: fn(q, freqs)
    return lambda: torch.autograd.grad(fn(q, freqs), q, dy)


def check(fmt: str, inputs: dict, pass_: str, args) -> float:
    """Largest relative error of the kernel's results against the reference on fp32 copies."""
    as32 = dict(inputs, q=inputs["q"].detach().float().requires_grad_(), dy=inputs["dy"].float())
    expected = results(rotate_fn("reference", fmt, args), as32, pass_)
    got = results(rotate_fn("kernel", fmt, args), inputs, pass_)
    return max(rel_err(a, e) for a, e in zip(got, expected))


def useful_bytes(q: torch.Tensor, pass_: str) -> float:
    """Minimal traffic: fwd reads q and writes out; fwdbwd adds reading dy and writing dq. The
    cos/sin tables (s x d_rot fp32) are noise next to them."""
    return (2 if pass_ == "fwd" else 4) * q.numel() * q.element_size()


def time_ms(fn: Callable[[], object], args) -> float:
    if not args.dry_run:
        return bench_ms(fn, args.warmup, args.rep)
    fn()  # CPU stand-in for do_bench: one run after one warm-up
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run_case(fmt: str, pass_: str, inputs: dict, args) -> dict:
    """{err} and per provider {ms, gbs}, or {fail} when the kernel is wrong (then not timed)."""
    err = check(fmt, inputs, pass_, args)
    tol = TOLERANCE[inputs["q"].dtype]
    if not err <= tol:
        return {"fail": f"FAIL rel err {err:.1e} > {tol:.0e}"}
    row = {"err": err}
    for provider in PROVIDERS:
        ms = time_ms(job(rotate_fn(provider, fmt, args), inputs, pass_), args)
        row[provider] = {"ms": ms, "gbs": useful_bytes(inputs["q"], pass_) / (ms * 1e-3) / 1e9}
    return row


def markdown(rows: list[dict], header: str) -> str:
    cols = ["format", "pass", "kernel ms", "kernel GB/s", "reference ms", "reference GB/s"]
    cols += ["speedup", "rel err"]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = [row["format"], row["pass"]]
        if "fail" in row:
            cells += [row["fail"]] + ["-"] * (len(cols) - 3)
        else:
            kernel, reference = row["kernel"], row["reference"]
            cells += [f"{kernel['ms']:.3f}", f"{kernel['gbs']:.0f}"]
            cells += [f"{reference['ms']:.3f}", f"{reference['gbs']:.0f}"]
            cells += [f"{reference['ms'] / kernel['ms']:.2f}x", f"{row['err']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12, help="query heads (the rotated slice)")
    p.add_argument("--gqa-groups", type=int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rotary-percent", type=float, default=1.0)
    p.add_argument("--interleaved", action="store_true", help="pair (2j, 2j+1)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--formats", type=csv_arg(FORMATS), default=list(FORMATS))
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on the CPU (Triton interpreter, wall-clock timer): checks the "
        "pipeline, measures nothing",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.batch, args.seqlen, args.heads, args.head_dim = 2, 16, 4, 16
        args.dtype = "fp16"
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    device = benchmark_device(args.dry_run)
    rows = []
    for fmt in args.formats:
        inputs = make_inputs(args, fmt, device)
        for pass_ in PASSES:
            rows.append({"format": fmt, "pass": pass_, **run_case(fmt, pass_, inputs, args)})
    gpu = device_label(device)
    header = (
        f"## RoPE: b={args.batch} s={args.seqlen} h={args.heads} d={args.head_dim} "
        f"rotary_percent={args.rotary_percent} interleaved={args.interleaved} {args.dtype} "
        f"({gpu}; torch {torch.__version__}; fusedlayers git {git_describe()})\n\n"
        "q is a head slice of a fused [.., h + 2*hg, d] QKV tensor. Median ms of "
        "triton.testing.do_bench (L2 flushed); GB/s over the minimal traffic (fwd: q + out; "
        "fwdbwd: q + out + dy + dq); speedup = reference ms / kernel ms; rel err of the kernel "
        "against the reference on fp32 copies."
    )
    table = markdown(rows, header)
    write_table(table, None, "rope.md")
    return table


if __name__ == "__main__":
    main()
