"""Is an attention call bound by the GPU or by the host? Per cell and forward path: a check for
host-device syncs, the host's enqueue time against the device time, allocator traffic, and the
kernels' device times.

The benchmark's do_bench times events around each call, so a call whose host work outlasts its
kernels reads the host's time instead. This script tells the two apart, one cell and forward
path at a time, on the benchmark's shapes (b = 16384/s, h = 2048/d, bf16, [b, h, s, d] inputs,
forward+backward of a random dout):

- `torch.cuda.set_sync_debug_mode("error")` around one call: a host-device sync raises, with
  where it happened;
- enqueue: host microseconds per call over 30 calls issued without waiting, against the same
  with the final synchronize; a call is host-bound where enqueue reaches the device time;
- cudaMalloc / cudaFree / allocator retries over those calls (each frees or syncs);
- do_bench of forward+backward and of the forward alone (no grad), and the kernels' device
  times from torch.profiler, CUDA API calls included.

    python examples/perf/host_or_device.py --cells 128:1024:1,128:1024:0 --paths sm90,portable
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmark_attention as ba  # noqa: E402
import torch  # noqa: E402
from bench_utils import bench_ms, configure_dynamo, csv_arg  # noqa: E402


def fwd_bwd(runner) -> None:
    for t in runner.leaves:
        t.grad = None
    runner.forward().backward(runner.dout)


def forward_only(runner) -> None:
    with torch.no_grad():
        runner.forward()


def cells_arg(text: str) -> list[tuple[int, int, bool]]:
    """argparse type: comma-separated d:s:causal cells, e.g. 128:1024:1."""
    cells = []
    for spec in text.split(","):
        parts = spec.strip().split(":")
        if len(parts) != 3 or not all(x.isdigit() for x in parts) or parts[2] not in "01":
            raise argparse.ArgumentTypeError(f"{spec!r}: expected d:s:causal, e.g. 128:1024:1")
        cells.append((int(parts[0]), int(parts[1]), parts[2] == "1"))
    return cells


def report(runner, flops: float, calls: int = 30) -> None:
    torch.cuda.set_sync_debug_mode("error")
    try:
        fwd_bwd(runner)
        print("  host-device sync in forward+backward: none")
    except RuntimeError:
        print("  host-device sync in forward+backward:")
        traceback.print_exc(limit=-12)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    start = time.perf_counter()
    for _ in range(calls):
        fwd_bwd(runner)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    after = torch.cuda.memory_stats()
    delta = {k: after.get(k, 0) - before.get(k, 0)
             for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}  # fmt: skip
    print(f"  enqueue {1e6 * (issued - start) / calls:.0f} us/call, with the final sync "
          f"{1e6 * (done - start) / calls:.0f}; allocator {delta}")  # fmt: skip
    ms = bench_ms(lambda: fwd_bwd(runner), 25, 200)
    ms_fwd = bench_ms(lambda: forward_only(runner), 25, 200)
    print(f"  do_bench forward+backward {ms * 1e3:.0f} us ({3.5 * flops / ms / 1e9:.0f} TFLOP/s), "
          f"forward {ms_fwd * 1e3:.0f} us ({flops / ms_fwd / 1e9:.0f} TFLOP/s)")  # fmt: skip
    from torch.profiler import ProfilerActivity, profile

    iters = 10
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fwd_bwd(runner)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        if on_gpu or event.name.startswith("cu"):
            entry = totals[("GPU " if on_gpu else "API ") + event.name[:90]]
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:16]:
        print(f"    {us / iters:9.1f} us x{n / iters:.1f}  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=cells_arg, default=cells_arg("128:1024:1,128:1024:0"),
                   help="d:s:causal, comma-separated")  # fmt: skip
    p.add_argument(
        "--paths", type=csv_arg(("sm90", "portable", "auto")), default=["sm90", "portable"]
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_or_device.py needs a CUDA GPU")
        return 2
    from fusedlayers.kernels import set_forward_path

    configure_dynamo()
    for d, s, causal in args.cells:
        for path in args.paths:
            previous = set_forward_path(path)
            hh = ba.HIDDEN // d
            case = ba.Case("sweep", "bf16", d, ba.TOKENS // s, hh, hh, s, causal)
            runner = ba.SETUPS["sweep"](case, lambda name: name == "fusedlayers").factories[
                "fusedlayers"
            ]()
            for _ in range(3):  # compile, then warm calls
                fwd_bwd(runner)
            torch.cuda.synchronize()
            print(f"\n== d={d} s={s} causal={int(causal)}, forward path {path}")
            report(runner, ba.attention_flops(case.b, hh, s, s, d, causal=causal))
            set_forward_path(previous)
            runner = None
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
