"""The sm_90 backward timed beside the portable backward, SDPA's cuDNN and flash backends.

    python examples/perf/tune_sm90_backward.py [--dims 128,64] [--seqlens 4096,16384]
        [--json PATH]

bf16, b = 16384 / s, h = 2048 / d, q/k/v [b, s, h, d], causal and not. Per provider: the
backward alone (autograd.grad of a retained graph, dout fixed) and forward+backward, medians of
`triton.testing.do_bench`, TFLOP/s counted as 4 b h s^2 d (halved when causal) for the forward,
2.5x that for the backward and 3.5x for forward+backward. "ours-sm90" and "ours-portable" share
the forward (`set_forward_path` left at "auto") and differ in `set_backward_path`. Before timing,
each of ours is checked against SDPA-flash's gradients (relative error under 1e-2). The rows
where ours-sm90 beats ours-portable are what `_backward_paths.SM90_BWD_MIN_KEYS` holds.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from fusedlayers.kernels import set_backward_path
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlayers import flash_attn_func

TOKENS, HIDDEN = 16384, 2048


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _providers(q, k, v, causal):
    """name -> forward returning out [b, s, h, d]; each sets its own kernel choice."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        return run

    def ours(path):
        def run():
            set_backward_path(path)  # read when the backward launches, so it stays set until then
            return flash_attn_func(q, k, v, causal=causal)

        return run

    return {
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "ours-portable": ours("portable"),
        "ours-sm90": ours("sm90"),
    }


def measure(d: int, s: int, causal: bool) -> list[dict]:
    b, h = TOKENS // s, HIDDEN // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
                     for _ in range(4))  # fmt: skip
    for t in (q, k, v):
        t.requires_grad_()
    fwd_flops = 4 * b * h * s * s * d / (2 if causal else 1)
    base = dict(d=d, s=s, b=b, h=h, causal=int(causal))
    reference = None
    rows = []
    for name, forward in _providers(q, k, v, causal).items():
        row = dict(base, provider=name)
        try:
            out = forward()
            grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            if reference is None and name == "sdpa-flash":
                reference = grads
            if name.startswith("ours") and reference is not None:
                err = max(((a.float() - r.float()).norm() / r.float().norm()).item()
                          for a, r in zip(grads, reference))  # fmt: skip
                row["rel_err"] = err
                if not err < 1e-2:
                    row["error"] = f"relative error {err:.2e} against sdpa-flash"
                    rows.append(row)
                    continue
            bwd_ms = timed(lambda o=out: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
            step_ms = timed(lambda f=forward: torch.autograd.grad(f(), (q, k, v), dout))
            row.update(bwd_ms=bwd_ms, fwdbwd_ms=step_ms,
                       bwd_tflops=2.5 * fwd_flops / bwd_ms / 1e9,
                       fwdbwd_tflops=3.5 * fwd_flops / step_ms / 1e9)  # fmt: skip
        except Exception as exc:  # a provider that fails is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
    set_backward_path("auto")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="128,64")
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, cuDNN {torch.backends.cudnn.version()}", flush=True)  # fmt: skip
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                block = measure(d, s, causal)
                rows.extend(block)
                cudnn = block[0].get("fwdbwd_tflops")
                cells = []
                for r in block:
                    if "error" in r:
                        cells.append(f"{r['provider']}: {r['error']}")
                    else:
                        ratio = r["fwdbwd_tflops"] / cudnn if cudnn else float("nan")
                        cells.append(f"{r['provider']} bwd {r['bwd_tflops']:.0f} fwd+bwd "
                                     f"{r['fwdbwd_tflops']:.0f} ({ratio:.2f}x)")  # fmt: skip
                print(f"d={d} s={s} causal={int(causal)}: " + " | ".join(cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
