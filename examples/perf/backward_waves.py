"""Where the sm_90 backward's wave minimum should sit (`dispatch.SM90_BWD_MIN_WAVES`).

For each shape and mask: forward+backward in bf16 with the backward pinned to the sm_90 kernels,
pinned to the portable ones and left to "auto", beside cuDNN (K/V repeated to the query heads).
One JSON line each: the program count (key blocks x b x h_kv), the waves it makes on this GPU,
each time in ms (`triton.testing.do_bench`), the sm_90 backward's speedup over the portable one
and the largest relative gradient difference between the two. Shapes are d:b:h:h_kv:s[:d_v]:

    python examples/perf/backward_waves.py waves.json 128:1:32:4:4096 128:4:32:1:4096 256:1:8:2:2048
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
from fusedlayers.kernels import set_backward_path
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers


def fwd_bwd(q, k, v, dout, causal):
    return torch.autograd.grad(fusedlayers.flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)


def cudnn_fwd_bwd(q, k, v, dout, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return torch.autograd.grad(out, (q, k, v), dout)


def measure(d, b, h, h_kv, s, d_v, causal, multiprocessors):
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(b, s, heads, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for heads, width in ((h, d), (h_kv, d), (h_kv, d_v))
    )
    dout = torch.randn(b, s, h, d_v, device="cuda", dtype=torch.bfloat16)
    programs = -(-s // (128 if d <= 128 else 64)) * b * h_kv
    row = dict(d=d, d_v=d_v, b=b, h=h, h_kv=h_kv, s=s, causal=causal, programs=programs,
               waves=round(programs / multiprocessors, 2))  # fmt: skip
    grads = {}
    for path in ("auto", "sm90", "portable"):
        set_backward_path(path)
        try:
            grads[path] = fwd_bwd(q, k, v, dout, causal)
            row[path] = round(triton.testing.do_bench(lambda: fwd_bwd(q, k, v, dout, causal)), 4)
        except Exception as error:  # a path that does not cover the shape says why
            row[path] = f"{type(error).__name__}: {str(error)[:120]}"
    set_backward_path("auto")
    if "sm90" in grads and "portable" in grads:
        row["sm90_speedup"] = round(row["portable"] / row["sm90"], 3)
        row["max_rel_diff"] = max(
            ((a.float() - c.float()).abs().max() / c.float().abs().max()).item()
            for a, c in zip(grads["sm90"], grads["portable"])
        )
    qt, kt, vt = (
        t.detach().transpose(1, 2).repeat_interleave(h // t.shape[2], 1) for t in (q, k, v)
    )
    qt, kt, vt = (t.requires_grad_() for t in (qt, kt, vt))
    dout_t = dout.transpose(1, 2)
    row["cudnn"] = round(
        triton.testing.do_bench(lambda: cudnn_fwd_bwd(qt, kt, vt, dout_t, causal)), 4
    )
    return row


def main(out: str, shapes: list[str]) -> None:
    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in shapes:
        d, b, h, h_kv, s, *rest = (int(n) for n in shape.split(":"))
        for causal in (False, True):
            rows.append(measure(d, b, h, h_kv, s, rest[0] if rest else d, causal, multiprocessors))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
