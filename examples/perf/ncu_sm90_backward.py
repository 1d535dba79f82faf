"""One sm_90 backward launch between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --profile-from-start off --kernel-name regex:_attn_bwd_sm90 --section WarpStateStats ... \\
        python examples/perf/ncu_sm90_backward.py [--d 128] [--seqlen 4096] [--causal 0]
        [--provider cudnn]

`--provider cudnn` profiles cuDNN's backward (SDPA's cuDNN backend, on the same inputs as
transposed views) instead, for a side-by-side reading of the same sections.

bf16, b = 16384 / s, h = 2048 / d, the shapes of tune_sm90_backward.py; warmed up first, so the
profiled launch is a compiled kernel on realistic inputs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from fusedlayers.kernels import set_backward_path
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlayers import flash_attn_func


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--causal", type=int, default=0)
    p.add_argument("--provider", choices=("ours", "cudnn"), default="ours")
    args = p.parse_args()
    s, d = args.seqlen, args.d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(16384 // s, s, 2048 // d, d, device="cuda", generator=g,
                                 dtype=torch.bfloat16) for _ in range(4))  # fmt: skip
    leaves = [t.requires_grad_() for t in (q, k, v)]
    if args.provider == "cudnn":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            qt, kt, vt = (t.transpose(1, 2) for t in leaves)
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(args.causal))
        out = out.transpose(1, 2)
    else:
        set_backward_path("sm90")
        out = flash_attn_func(*leaves, causal=bool(args.causal))
    for _ in range(3):
        torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
