"""Host (CPU) time per attention call: the front end, the custom op and the Triton launch.

Small problems are launch-bound: when the host needs longer to issue a call than the GPU needs to
run it, the GPU waits, and that wait is what a user sees. This script times, on tiny shapes where
GPU time is negligible, the host time per call of `flash_attn_func` and of SDPA (flash backend),
then profiles the fusedlayers call so the expensive Python frames are named.

    python examples/launch_overhead.py        # table, then the top frames by cumulative time
    python examples/launch_overhead.py --calls 2000 --top 40
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers


def host_us_per_call(fn: Callable[[], object], calls: int) -> float:
    """Mean host time of `fn` over `calls` calls, after a warm-up; the GPU is drained first."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def main(calls: int = 1000, top: int = 30) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def ours():
        return fusedlayers.flash_attn_func(q, k, v, causal=True)

    def ours_fwdbwd():
        out = fusedlayers.flash_attn_func(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    def sdpa(grad: bool = False):
        a, b, c = (t.transpose(1, 2) for t in ((qg, kg, vg) if grad else (q, k, v)))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(a, b, c, is_causal=True)
        if grad:
            torch.autograd.grad(out, (qg, kg, vg), dout.transpose(1, 2))
        return out

    rows = [
        ("fusedlayers fwd", host_us_per_call(ours, calls)),
        ("sdpa-flash fwd", host_us_per_call(sdpa, calls)),
        ("fusedlayers fwd+bwd", host_us_per_call(ours_fwdbwd, calls // 2)),
        ("sdpa-flash fwd+bwd", host_us_per_call(lambda: sdpa(True), calls // 2)),
    ]
    print("| call | host us/call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        ours_fwdbwd()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
    print(text.getvalue())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    main(args.calls, args.top)
