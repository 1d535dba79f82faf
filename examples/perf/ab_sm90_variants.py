"""Same-process A/B of the sm_90 kernels' variants, beside the portable kernels and cuDNN.

    python examples/perf/ab_sm90_variants.py --pass fwd --dims 64 [--seqlens 1024,4096,16384]
        [--rounds 3] [--json PATH]

The variants are what the kernels' tables select per head dim, flipped in this process. `--pass
fwd`: the sm_90 forward with two and with three consumer warpgroups (`_flash_fwd_sm90.CONSUMERS`),
timed as a training step calls it (inputs need gradients). A backward variant goes beside it the
same way (its table flipped in `variants`, the backward alone timed by autograd.grad of a
retained graph, and forward+backward).

bf16, b = 16384 / s, h = 2048 / d, causal and not. Each variant's result is first checked
against the portable kernels' (relative error under 1e-2, else the row says WRONG and nothing
is timed). The providers then run in `--rounds` interleaved rounds (`triton.testing.do_bench`
medians), so a drift of the GPU's clock over the run reaches every provider alike; the table
gives the median of the rounds. TFLOP/s count 4 b h s^2 d (halved when causal) for the forward,
2.5x that for the backward and 3.5x for forward+backward.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
from fusedlayers.kernels import _flash_fwd_sm90, set_backward_path, set_forward_path
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlayers import flash_attn_func

TOKENS, HIDDEN = 16384, 2048


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def variants(pass_: str, d: int) -> dict:
    """name -> a function that selects that variant (paths and tables) before a call."""

    def fwd(path, consumers=None):
        def select():
            set_forward_path(path)
            set_backward_path("auto")
            if consumers is not None:
                _flash_fwd_sm90.CONSUMERS[d] = consumers

        return select

    return {
        "sm90-2wg": fwd("sm90", 2),
        "sm90-3wg": fwd("sm90", 3),
        "portable": fwd("portable"),
    }


def measure(pass_: str, d: int, s: int, causal: bool, rounds: int) -> dict:
    b, h = TOKENS // s, HIDDEN // d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

    def ours():
        return flash_attn_func(q, k, v, causal=causal)

    chosen = variants(pass_, d)

    def result(select):
        select()
        out = ours()
        if pass_ == "fwd":
            return [out.detach().float()]
        return [g.float() for g in torch.autograd.grad(out, (q, k, v), dout)]

    reference = result(chosen["portable"])
    errors, wrong = {}, set()
    for name, select in chosen.items():
        got = result(select)
        errors[name] = max(
            ((a - r).norm() / r.norm()).item() for a, r in zip(got, reference, strict=True)
        )
        if not errors[name] < 1e-2:
            wrong.add(name)

    def timings(select, fn):
        if select is not None:
            select()
        if pass_ == "fwd":
            return {"fwd": timed(fn)}
        out = fn()
        return {
            "bwd": timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)),
            "fwdbwd": timed(lambda: torch.autograd.grad(fn(), (q, k, v), dout)),
        }

    providers = {name: (sel, ours) for name, sel in chosen.items() if name not in wrong}
    providers["cudnn"] = (None, cudnn)
    runs: dict[str, list[dict]] = {name: [] for name in providers}
    for _ in range(rounds):
        for name, (select, fn) in providers.items():
            runs[name].append(timings(select, fn))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    scale = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
    row = {"d": d, "s": s, "causal": int(causal), "errors": errors, "wrong": sorted(wrong)}
    for name, rs in runs.items():
        for kind in rs[0]:
            ms = statistics.median(r[kind] for r in rs)
            row[f"{name}/{kind}"] = {
                "ms": ms,
                "tflops": scale[kind] * flops / ms / 1e9,
                "rounds_ms": [r[kind] for r in rs],
            }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pass", dest="pass_", choices=("fwd",), default="fwd")
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
                    row = measure(args.pass_, d, s, causal, args.rounds)
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
        set_backward_path("auto")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
