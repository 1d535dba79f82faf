"""Tile sweep for the sm_90 forward kernel, timed beside cuDNN and the portable kernel.

    python examples/perf/tune_sm90.py [--dims 128,64] [--seqlens 1024,4096,16384] [--json PATH]

bf16, b = 16384 / s, h = 2048 / d, causal and not: for each (BLOCK_N, NUM_STAGES) candidate of
the sm_90 kernel (`kernels/_flash_fwd_sm90.TILES`), the forward is checked against SDPA's flash
backend (relative error under 1e-2) and timed with `triton.testing.do_bench` (median) through
`flash_attn_func` on inputs that need gradients, as a training step calls it (host time
included). The same problem through SDPA's cuDNN backend and through the portable Triton kernel
gives the ratios.
The best candidate per head dim, and the lengths where the portable kernel wins, are what
`TILES` and `dispatch.SM90_MIN_KEYS` (`SM90_MIN_KEYS_CAUSAL` for causal calls) hold.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from fusedlayers.kernels import _flash_fwd_sm90, set_forward_path
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlayers import flash_attn_func

TOKENS, HIDDEN = 16384, 2048
CANDIDATES = {128: [(128, 2), (128, 3)], 64: [(128, 3), (128, 4)]}


def tflops(b, h, s, d, causal, ms) -> float:
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    return flops / ms / 1e9


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sweep(d: int, s: int, causal: bool) -> list[dict]:
    b, h = TOKENS // s, HIDDEN // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))  # fmt: skip
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
        ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

    def ours():  # as a training step calls it: through flash_attn_func, inputs needing grad
        return flash_attn_func(q, k, v, causal=causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    rows = []
    base = dict(d=d, s=s, b=b, h=h, causal=int(causal))
    rows.append(dict(base, provider="sdpa-cudnn", tflops=tflops(b, h, s, d, causal, timed(cudnn))))
    previous = set_forward_path("portable")
    try:
        ms = timed(ours)
    finally:
        set_forward_path(previous)
    rows.append(dict(base, provider="portable", tflops=tflops(b, h, s, d, causal, ms)))
    default = _flash_fwd_sm90.TILES[d]
    previous = set_forward_path("sm90")
    try:
        for tile in CANDIDATES[d]:
            _flash_fwd_sm90.TILES[d] = tile
            row = dict(base, provider=f"sm90 {tile}")
            try:
                out = ours()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    row["error"] = f"relative error {err:.2e}"
                else:
                    row["tflops"] = tflops(b, h, s, d, causal, timed(ours))
            except Exception as exc:  # a candidate that fails to build is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    finally:
        _flash_fwd_sm90.TILES[d] = default
        set_forward_path(previous)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="128,64")
    p.add_argument("--seqlens", default="1024,2048,4096,16384")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                rows.extend(sweep(d, s, causal))
                cudnn = rows[-len(CANDIDATES[d]) - 2]["tflops"]
                cells = " ".join(
                    f"{r['provider']}={r['tflops']:.0f}({r['tflops'] / cudnn:.2f}x)"
                    if "tflops" in r else f"{r['provider']}={r['error']}"
                    for r in rows[-len(CANDIDATES[d]) - 2:]
                )  # fmt: skip
                print(f"d={d} s={s} causal={int(causal)}: {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
