"""The sm_90 backward timed beside the portable backward, SDPA's cuDNN and flash backends.

    python examples/perf/tune_sm90_backward.py [--dims 128,64] [--seqlens 4096,16384]
        [--block-m 64,128] [--json PATH]

bf16, b = 16384 / s, h = 2048 / d, q/k/v [b, s, h, d], causal and not. Per provider: the
backward alone (autograd.grad of a retained graph, dout fixed) and forward+backward, medians of
`triton.testing.do_bench`, TFLOP/s counted as 4 b h s^2 d (halved when causal) for the forward,
2.5x that for the backward and 3.5x for forward+backward. "ours-sm90" and "ours-portable" share
the forward (`set_forward_path` left at "auto") and differ in `set_backward_path`. Before timing,
each of ours is checked against SDPA-flash's gradients (relative error under 1e-2), and each
sm_90 variant against ours-portable's too (`rel_err_portable`, same bound). The rows where
ours-sm90 beats ours-portable are what `dispatch.SM90_BWD_MIN_KEYS` holds.

`--block-m 64,128` times, at the head dims that have both (`_flash_bwd_sm90.TILES_M128`: d = 64),
the sm_90 backward with 64- and 128-row query steps in the same process beside the portable
backward: the default tiles as "ours-sm90" (128 rows at d = 64), the other as "ours-sm90-m64":

    python examples/perf/tune_sm90_backward.py --dims 64 --seqlens 1024,4096,16384 --block-m 64,128
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from fusedlayers.kernels import _flash_bwd_sm90, set_backward_path
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlayers import flash_attn_func

TOKENS, HIDDEN = 16384, 2048


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _providers(q, k, v, causal, block_ms=(64,)):
    """name -> forward returning out [b, s, h, d]; each sets its own kernel choice."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    width = _flash_bwd_sm90.tile_width(q.shape[-1])  # the tables are per tile width

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        return run

    def ours(path, tiles=None):
        def run():
            # Both read when the backward launches, so they stay set until then.
            set_backward_path(path)
            if tiles is not None:
                _flash_bwd_sm90.TILES[width] = tiles
            return flash_attn_func(q, k, v, causal=causal)

        return run

    providers = {
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "ours-portable": ours("portable"),
    }
    default = _flash_bwd_sm90.TILES[width]
    variants = {default[0]: ("ours-sm90", default)}
    if width in _flash_bwd_sm90.TILES_M128:  # d = 64: both step heights, whichever is default
        for tiles in (_flash_bwd_sm90.TILES_M128[width], (64, default[1])):
            variants.setdefault(tiles[0], (f"ours-sm90-m{tiles[0]}", tiles))
    for block_m in block_ms:
        if block_m in variants:
            name, tiles = variants[block_m]
            providers[name] = ours("sm90", tiles)
    return providers


def _rel_err(grads, reference) -> float:
    return max(((a.float() - r.float()).norm() / r.float().norm()).item()
               for a, r in zip(grads, reference))  # fmt: skip


def measure(d: int, s: int, causal: bool, block_ms=(64,)) -> list[dict]:
    b, h = TOKENS // s, HIDDEN // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
                     for _ in range(4))  # fmt: skip
    for t in (q, k, v):
        t.requires_grad_()
    fwd_flops = 4 * b * h * s * s * d / (2 if causal else 1)
    base = dict(d=d, s=s, b=b, h=h, causal=int(causal))
    reference = portable = None
    width = _flash_bwd_sm90.tile_width(d)
    default_tiles = _flash_bwd_sm90.TILES[width]
    rows = []
    for name, forward in _providers(q, k, v, causal, block_ms).items():
        row = dict(base, provider=name)
        try:
            out = forward()
            grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            if reference is None and name == "sdpa-flash":
                reference = grads
            if name == "ours-portable":
                portable = grads
            checks = []
            if name.startswith("ours") and reference is not None:
                row["rel_err"] = _rel_err(grads, reference)
                checks.append(("sdpa-flash", row["rel_err"]))
            if name.startswith("ours-sm90") and portable is not None:
                row["rel_err_portable"] = _rel_err(grads, portable)
                checks.append(("ours-portable", row["rel_err_portable"]))
            bad = [f"relative error {e:.2e} against {n}" for n, e in checks if not e < 1e-2]
            if bad:
                row["error"] = "; ".join(bad)
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
    _flash_bwd_sm90.TILES[width] = default_tiles
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="128,64")
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument(
        "--block-m",
        default="64",
        help="sm_90 backward BLOCK_M values to time, e.g. 64,128 (128: the d = 64 "
        "variant in _flash_bwd_sm90.TILES_M128; skipped where a d has none)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    block_ms = tuple(int(x) for x in args.block_m.split(","))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}, cuDNN {torch.backends.cudnn.version()}", flush=True)  # fmt: skip
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                block = measure(d, s, causal, block_ms)
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
