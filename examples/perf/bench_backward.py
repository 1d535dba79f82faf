"""Backward-only timing: two-pass (deterministic=True) vs atomic-dQ (deterministic=False) backward.

Run on CUDA: `python examples/perf/bench_backward.py [--out FILE]` (under 3 minutes on an H100).
bf16, b * s = 16384 tokens, h * d = 2048, d in {64, 128}, s in {1024, 4096, 16384}, causal or
not, plus GQA 32:8 at d = 128, s = 4096. Each provider runs its forward once; the median time of
`torch.autograd.grad` on that output with a fixed dout (triton.testing.do_bench) is its backward.
SDPA's FlashAttention-2 and cuDNN backends read the same tensors as [b, h, s, d]. The two paths'
dq/dk/dv must agree (norm-wise relative error < 2e-2) before they are timed. TFLOP/s count the
backward as 2.5x the forward's 4*b*h*s*s*d, halved when causal. `--smoke`: tiny fp32 shapes on
the CPU under the Triton interpreter, to check the script itself (times mean nothing there).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# bench_utils and benchmark_attention live one folder up, in examples/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from bench_utils import bench_ms  # noqa: E402

TOKENS, HIDDEN, TOLERANCE = 16384, 2048, 2e-2
PATHS = (("two-pass", True), ("atomic", False))  # (name, deterministic)


def shapes(smoke: bool) -> list[tuple[int, int, int, int, int, bool]]:
    """(b, s, h, h_kv, d, causal) rows to time."""
    if smoke:
        return [(1, 40, 4, 2, 16, causal) for causal in (False, True)]
    grid = [(d, s, causal) for d in (64, 128) for s in (1024, 4096, 16384) for causal in (0, 1)]
    rows = [(TOKENS // s, s, HIDDEN // d, HIDDEN // d, d, bool(c)) for d, s, c in grid]
    return rows + [(TOKENS // 4096, 4096, 32, 8, 128, causal) for causal in (False, True)]


def median_ms(fn: Callable[[], object], smoke: bool) -> float:
    """do_bench's median on CUDA (bench_utils); three wall-clock runs under --smoke."""
    if not smoke:
        return bench_ms(fn, warmup=25, rep=100)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def backward_only(forward: Callable, inputs: list[torch.Tensor], dout: torch.Tensor) -> Callable:
    """Run `forward` once; the returned callable is the backward alone (graph kept for reruns)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = forward(*leaves)
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def sdpa_ms(q, k, v, dout, causal: bool) -> dict[str, float]:
    """Backward times of SDPA's flash and cuDNN backends ([b, h, s, d]); NaN where unsupported."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    gqa = q.shape[2] != k.shape[2]
    inputs = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    results = {}
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip

        def forward(*xs, backend=backend):
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(*xs, is_causal=causal, enable_gqa=gqa)

        try:
            results[name] = median_ms(backward_only(forward, inputs, dout.transpose(1, 2)), False)
        except RuntimeError as error:  # a backend without this shape: report, keep going
            print(f"  {name}: {str(error).strip().splitlines()[0][:120]}")
            results[name] = math.nan
    return results


def bench_case(b: int, s: int, h: int, h_kv: int, d: int, causal: bool, smoke: bool) -> dict:
    from fusedlayers.kernels import flash_attention

    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(b, s, h, d, generator=g, device=device, dtype=dtype) for _ in "qo")
    k, v = (torch.randn(b, s, h_kv, d, generator=g, device=device, dtype=dtype) for _ in "kv")
    window = (-1, 0) if causal else (-1, -1)
    runs = {}
    for name, deterministic in PATHS:

        def forward(q, k, v, deterministic=deterministic):
            return flash_attention(q, k, v, softmax_scale=d**-0.5, window_size=window,
                                   deterministic=deterministic)[0]  # fmt: skip

        runs[name] = backward_only(forward, [q, k, v], dout)
    grads = {name: run() for name, run in runs.items()}
    err = max(rel_err(a, r) for a, r in zip(grads["atomic"], grads["two-pass"]))
    if err > TOLERANCE:
        return dict(err=err, ms={})  # a fast wrong answer is no result: not timed
    ms = {name: median_ms(run, smoke) for name, run in runs.items()}
    if not smoke:
        ms |= sdpa_ms(q, k, v, dout, causal)
    return dict(err=err, ms=ms)


def table_row(b: int, s: int, h: int, h_kv: int, d: int, causal: bool, result: dict) -> str:
    ms = result["ms"]
    flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    cells = [str(x) for x in (d, s, b, h, h_kv, int(causal))]
    for name in ("two-pass", "atomic", "sdpa-flash", "cudnn"):
        t = ms.get(name, math.nan)
        cells.append("-" if math.isnan(t) else f"{t:.3f} ({flops / t * 1e-9:.0f})")
    for name in ("two-pass", "sdpa-flash", "cudnn"):
        ratio = ms.get(name, math.nan) / ms.get("atomic", math.nan)
        cells.append("-" if math.isnan(ratio) else f"{ratio:.2f}")
    cells.append(f"{result['err']:.1e}" + ("" if ms else " WRONG"))
    return "| " + " | ".join(cells) + " |"


def main(out: str | None, smoke: bool) -> None:
    from fusedlayers.kernels import _flash_bwd  # after TRITON_INTERPRET is settled (--smoke)

    # The atomic scheme is off by default until this script shows it faster; enable it here. The
    # interpreter (--smoke) takes it only with "any".
    _flash_bwd.ATOMIC_DQ_DEVICES = "any" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke for a CPU check of the script)")
    head = ("| d | s | b | h | h_kv | causal | two-pass ms (TF/s) | atomic ms (TF/s) | sdpa-flash "
            "ms (TF/s) | cudnn ms (TF/s) | two-pass/atomic | flash/atomic | cudnn/atomic | "
            "rel err |")  # fmt: skip
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    print("\n".join(lines), flush=True)
    for shape in shapes(smoke):
        lines.append(table_row(*shape, bench_case(*shape, smoke)))
        print(lines[-1], flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (Triton interpreter)")
    args = parser.parse_args()
    if args.smoke and not torch.cuda.is_available():
        # Read when triton.jit decorates the kernels, i.e. at the first fusedlayers import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    main(args.out, args.smoke)
