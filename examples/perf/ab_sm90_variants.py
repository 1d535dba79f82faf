"""Same-process A/B of the sm_90 forward's variants, beside the portable kernel and cuDNN.

    python examples/perf/ab_sm90_variants.py --dims 64 [--seqlens 1024,4096,16384] [--rounds 3]
        [--json PATH]

The variants are what the kernel's tables select per head dim, flipped in this process: the sm_90
forward with two and with three consumer warpgroups (`_flash_fwd_sm90.CONSUMERS`), timed as a
training step calls it (inputs need gradients). To compare another variant, add its table flip
to `variants`.

bf16, b = 16384 / s, h = 2048 / d, causal and not. Each variant's output is first checked
against the portable kernel's (relative error under 1e-2, else the row says WRONG and it is not
timed). The providers then run in `--rounds` interleaved rounds (`triton.testing.do_bench`
medians), so a drift of the GPU's clock over the run reaches every provider alike; the table
gives the median of the rounds. TFLOP/s count 4 b h s^2 d, halved when causal.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
from fusedlayers.kernels import _flash_fwd_sm90, set_forward_path
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlayers import flash_attn_func

TOKENS, HIDDEN = 16384, 2048


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def variants(d: int) -> dict:
    """name -> a function that selects that variant (path and table) before a call."""

    def fwd(path, consumers=None):
        def select():
            set_forward_path(path)
            if consumers is not None:
                _flash_fwd_sm90.CONSUMERS[d] = consumers

        return select

    return {
        "sm90-2wg": fwd("sm90", 2),
        "sm90-3wg": fwd("sm90", 3),
        "portable": fwd("portable"),
    }


def measure(d: int, s: int, causal: bool, rounds: int) -> dict:
    b, h = TOKENS // s, HIDDEN // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(
            True
        )
        for _ in range(3)
    )
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

    def ours():
        return flash_attn_func(q, k, v, causal=causal)

    chosen = variants(d)

    def result(select):
        select()
        return ours().detach().float()

    reference = result(chosen["portable"])
    errors, wrong = {}, set()
    for name, select in chosen.items():
        errors[name] = ((result(select) - reference).norm() / reference.norm()).item()
        if not errors[name] < 1e-2:
            wrong.add(name)

    providers = {name: (sel, ours) for name, sel in chosen.items() if name not in wrong}
    providers["cudnn"] = (None, cudnn)
    runs: dict[str, list[float]] = {name: [] for name in providers}
    for _ in range(rounds):
        for name, (select, fn) in providers.items():
            if select is not None:
                select()
            runs[name].append(timed(fn))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    row = {"d": d, "s": s, "causal": int(causal), "errors": errors, "wrong": sorted(wrong)}
    for name, rs in runs.items():
        ms = statistics.median(rs)
        row[f"{name}/fwd"] = {"ms": ms, "tflops": flops / ms / 1e9, "rounds_ms": rs}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(
        torch.cuda.get_device_name(), torch.__version__, triton.__version__,
        f"cuDNN {torch.backends.cudnn.version()}", flush=True,
    )  # fmt: skip
    saved = dict(_flash_fwd_sm90.CONSUMERS)
    rows = []
    try:
        for d in (int(x) for x in args.dims.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                for causal in (False, True):
                    row = measure(d, s, causal, args.rounds)
                    rows.append(row)
                    cells = [
                        f"{key} {val['tflops']:.0f}"
                        for key, val in row.items()
                        if isinstance(val, dict) and "tflops" in val
                    ]
                    errors = " ".join(f"{n}={e:.1e}" for n, e in row["errors"].items())
                    wrong = f" WRONG: {row['wrong']}" if row["wrong"] else ""
                    print(
                        f"d={d} s={s} causal={int(causal)} | " + " | ".join(cells)
                        + f" | err vs portable: {errors}{wrong}", flush=True,
                    )  # fmt: skip
    finally:
        _flash_fwd_sm90.CONSUMERS.update(saved)
        set_forward_path("auto")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
