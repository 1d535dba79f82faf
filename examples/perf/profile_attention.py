"""Where the time of one attention forward+backward goes, kernel by kernel, for each provider.

The benchmark reports one number per pass; this script splits it: per provider, the device time
of every kernel one forward+backward launches (torch.profiler, averaged over `--iters` calls after
warm-up, so autotuning and compiling are excluded) against the wall time of the call. Gaps
between the two are host time or launch latency; a kernel that is slower than its counterpart in
another provider is where to look next.

    python examples/perf/profile_attention.py --dims 128 --seqlens 4096 --causal 0,1
    ncu --profile-from-start off --kernel-name regex:bwd ... \\
        python examples/perf/profile_attention.py --ncu --providers fusedlayers --dims 128 \\
        --seqlens 4096

`--forward-path sm90|portable|auto` pins the forward kernel of the "fusedlayers" provider for the
whole run ("fusedlayers-portable" pins the portable forward either way), e.g. to compare the
sm_90 forward with the portable one where "auto" takes only one of them:

    python examples/perf/profile_attention.py --providers fusedlayers,fusedlayers-portable \
        --dims 128 --seqlens 1024 --causal 1 --forward-path sm90

`--ncu`: after warm-up, one forward+backward per provider and case between
cudaProfilerStart/Stop, for Nsight Compute's `--profile-from-start off`. Shapes follow the
benchmark (b = 16384/s, h = 2048/d, bf16, [b, h, s, d] inputs) and its providers are built by
benchmark_attention.py, so the same inputs and calls are profiled as are timed there. L2 is not
flushed between calls here (the benchmark flushes it); at these sizes each operand is 64 MiB,
larger than the 50 MiB L2, so that changes little.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

# bench_utils and benchmark_attention live one folder up, in examples/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmark_attention as ba  # noqa: E402
import torch  # noqa: E402
from bench_utils import configure_dynamo, csv_arg, ints_arg  # noqa: E402


def fwd_bwd(runner) -> None:
    for t in runner.leaves:
        t.grad = None
    runner.forward().backward(runner.dout)


def kernel_times(runner, iters: int) -> tuple[list[tuple[str, float, int]], float]:
    """([(kernel name, us per call, launches per call)], wall us per call) of `iters` calls."""
    from torch.profiler import ProfilerActivity, profile

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(iters):
            fwd_bwd(runner)
        end.record()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = totals[event.name]
        entry[0] += event.time_range.elapsed_us()
        entry[1] += 1
    rows = [(name, us / iters, n // iters) for name, (us, n) in totals.items()]
    rows.sort(key=lambda r: -r[1])
    return rows, start.elapsed_time(end) * 1e3 / iters


def short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--providers", type=csv_arg(ba.PROVIDERS), default=["fusedlayers", "flex",
                   "sdpa-cudnn", "sdpa-flash"])  # fmt: skip
    p.add_argument("--dims", type=ints_arg, default=[128])
    p.add_argument("--seqlens", type=ints_arg, default=[4096])
    p.add_argument("--causal", type=csv_arg(("0", "1")), default=["0", "1"])
    p.add_argument("--dtype", choices=list(ba.DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ncu", action="store_true", help="one profiled call per provider and case")
    p.add_argument("--forward-path", choices=("auto", "sm90", "portable"), default="auto")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_attention.py needs a CUDA GPU")
        return 2
    from fusedlayers.kernels import set_forward_path

    configure_dynamo()
    torch.manual_seed(0)
    set_forward_path(args.forward_path)
    for d in args.dims:
        for s in args.seqlens:
            for causal in (c == "1" for c in args.causal):
                hh = ba.HIDDEN // d
                case = ba.Case("sweep", args.dtype, d, ba.TOKENS // s, hh, hh, s, causal)
                setup = ba.SETUPS["sweep"](case, lambda name: name in args.providers)
                flops = ba.attention_flops(case.b, hh, s, s, d, causal=causal) * 3.5
                print(f"\n== {case.label}: fwd+bwd")
                for name, factory in setup.factories.items():
                    runner = factory()
                    for _ in range(3):  # autotune, compile, then a warm call
                        fwd_bwd(runner)
                    torch.cuda.synchronize()
                    if args.ncu:
                        torch.cuda.cudart().cudaProfilerStart()
                        fwd_bwd(runner)
                        torch.cuda.synchronize()
                        torch.cuda.cudart().cudaProfilerStop()
                        print(f"  {name}: profiled one call")
                        continue
                    rows, wall = kernel_times(runner, args.iters)
                    busy = sum(us for _, us, _ in rows)
                    print(f"  {name}: wall {wall:.0f} us/call ({flops / wall / 1e6:.0f} TF/s), "
                          f"kernels {busy:.0f} us")  # fmt: skip
                    for kname, us, n in rows:
                        print(f"    {us:8.1f} us  x{n}  {short(kname)}")
                    runner = None
                    torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
