"""Forward timing: fusedlayers' Triton kernel vs PyTorch SDPA (FlashAttention-2 backend).

Run on a CUDA machine: `python examples/perf/bench_forward.py [--out FILE]`. Same inputs for both
providers (ours reads q/k/v as [b, s, h, d], SDPA as [b, h, s, d]; both contiguous), bf16,
median of `triton.testing.do_bench`. TFLOP/s counted as 4*b*h*s_q*s_k*d (halved when causal).
Also prints max |ours - sdpa| and the autotuned config per shape.
"""

from __future__ import annotations

import argparse

import torch
import triton
from fusedlayers.kernels._flash_fwd import _attn_fwd, flash_attention_forward
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

SHAPES = [  # (b, h, s, d)
    (8, 16, 2048, 128),
    (4, 16, 4096, 128),
    (16, 32, 1024, 64),
]


def _ours(q, k, v, causal: bool):
    return flash_attention_forward(
        q, k, v,
        cu_seqlens_q=None, cu_seqlens_k=None, seq_offsets_q=None, seq_offsets_k=None,
        max_seqlen_q=None, max_seqlen_k=None, seqlens_q=None, seqlens_k=None,
        softmax_scale=q.shape[-1] ** -0.5, window_left=-1, window_right=0 if causal else -1,
        bottom_right=True, bias=None, alibi_slopes=None, softcap=0.0, dropout_p=0.0,
        seed=0, offset=0,
    )[0]  # fmt: skip


def bench_shape(b: int, h: int, s: int, d: int, causal: bool) -> dict:
    """Times both providers on one shape; returns a row of results."""
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q_t, k_t, v_t = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [b, h, s, d]

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(q_t, k_t, v_t, is_causal=causal)

    diff = (_ours(q, k, v, causal).transpose(1, 2).float() - sdpa().float()).abs().max().item()
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    ms_ours = triton.testing.do_bench(lambda: _ours(q, k, v, causal), return_mode="median")
    ms_sdpa = triton.testing.do_bench(sdpa, return_mode="median")
    return dict(
        shape=f"b={b} h={h} s={s} d={d} causal={int(causal)}",
        ours_ms=ms_ours,
        sdpa_ms=ms_sdpa,
        ours_tflops=flops / ms_ours * 1e-9,
        sdpa_tflops=flops / ms_sdpa * 1e-9,
        speedup=ms_sdpa / ms_ours,
        max_diff=diff,
        config=str(_attn_fwd.best_config),
    )


def main(out: str | None) -> None:
    lines = [
        f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}"
    ]
    for b, h, s, d in SHAPES:
        for causal in (False, True):
            r = bench_shape(b, h, s, d, causal)
            lines.append(
                f"{r['shape']:<36} ours {r['ours_ms']:.3f} ms {r['ours_tflops']:.0f} TF/s | "
                f"sdpa-flash {r['sdpa_ms']:.3f} ms {r['sdpa_tflops']:.0f} TF/s | "
                f"x{r['speedup']:.2f} | max|diff| {r['max_diff']:.2e} | {r['config']}"
            )
            print(lines[-1], flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this file")
    main(parser.parse_args().out)
