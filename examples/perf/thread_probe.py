"""The same host work timed on the main thread and inside an autograd backward.

On CUDA, autograd runs a backward on its own device thread, usually scheduled on another core
than the thread that called `backward()`. The Python objects a backward touches (code, dicts,
tensors' metadata) then travel between the two cores' caches on every call. This script times
one fixed piece of host work (four launch signatures over five tensors and two CUDA
allocations, what a launcher does) in three ways, best of five rounds, in microseconds:
- on the main thread alone;
- inside a no-op `autograd.Function`'s backward alone;
- alternating (main-thread work, then a backward), as a training step alternates forward and
  backward.

    python examples/perf/thread_probe.py
    taskset -c 5 python examples/perf/thread_probe.py     # every thread on one core

docs/performance.md ("Host time on autograd's device thread") quotes both on the H100's host.
"""

from __future__ import annotations

import os
import time

import torch
from fusedlayers.kernels._launch import call_signature


def main(calls: int = 300, rounds: int = 5) -> None:
    device = "cuda"
    x = torch.randn(1, 128, 4, 64, device=device, dtype=torch.bfloat16)
    tensors = tuple(torch.randn_like(x) for _ in range(5))

    def work():
        for _ in range(4):
            call_signature(tensors, (1, 2.0, None))
        return torch.empty(1000, device=device), torch.empty_like(x)

    spent = [0.0]

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            start = time.perf_counter()
            work()
            spent[0] += time.perf_counter() - start
            return grad

    leaf = x.clone().requires_grad_()
    out = Probe.apply(leaf)

    def backward():
        torch.autograd.grad(out, leaf, x, retain_graph=True)

    def main_only() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            work()
        return (time.perf_counter() - start) / calls * 1e6

    def backward_only() -> float:
        spent[0] = 0.0
        for _ in range(calls):
            backward()
        return spent[0] / calls * 1e6

    def alternating() -> tuple[float, float]:
        spent[0], on_main = 0.0, 0.0
        for _ in range(calls):
            start = time.perf_counter()
            work()
            on_main += time.perf_counter() - start
            backward()
        return on_main / calls * 1e6, spent[0] / calls * 1e6

    for _ in range(50):
        work()
        backward()
    readings = [(main_only(), backward_only(), *alternating()) for _ in range(rounds)]
    best = [min(column) for column in zip(*readings)]
    cores = sorted(os.sched_getaffinity(0))
    print(
        f"{len(cores)} cores allowed ({cores[:4]}...): main thread alone {best[0]:.1f} us | "
        f"in a backward alone {best[1]:.1f} us | alternating: main {best[2]:.1f} us, "
        f"backward {best[3]:.1f} us"
    )


if __name__ == "__main__":
    main()
