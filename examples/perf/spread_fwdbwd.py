"""d=128 forward+backward against cuDNN in one process, for reading the spread between processes.

    for i in 1 2 3; do python examples/perf/spread_fwdbwd.py; done

bf16, b = 16384 / s, h = 16, s = 4k and 16k, causal and not; inputs [b, s, h, d] requiring grad,
cuDNN (SDPA pinned) on their [b, h, s, d] transposed views. Each provider is timed twice,
interleaved (`triton.testing.do_bench` medians), and the better of its two readings is printed.
TFLOP/s count 3.5 x 4 b h s^2 d, halved when causal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlayers import flash_attn_func


def measure(s: int, causal: bool, d: int = 128, h: int = 16) -> tuple[float, float]:
    """(ours, cuDNN) forward+backward TFLOP/s, each the better of two interleaved readings."""
    b = 16384 // s
    q, k, v = (
        torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn_like(q)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def ours():
        flash_attn_func(q, k, v, causal=causal).backward(dout)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        out.transpose(1, 2).backward(dout)

    times = {ours: [], cudnn: []}
    for fn in (ours, cudnn) * 2:
        times[fn].append(
            triton.testing.do_bench(
                fn, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="median"
            )
        )
    flops = 4 * b * h * s * s * d * 3.5 / (2 if causal else 1)
    return flops / min(times[ours]) / 1e9, flops / min(times[cudnn]) / 1e9


def main() -> None:
    for s in (4096, 16384):
        for causal in (False, True):
            ours, cudnn = measure(s, causal)
            print(
                f"s={s} causal={int(causal)} ours {ours:.0f} cudnn {cudnn:.0f} "
                f"ratio {ours / cudnn:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
