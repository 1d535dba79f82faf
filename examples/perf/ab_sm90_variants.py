"""Same-process A/B of kernel variants beside cuDNN: sm_90 kernel tables, causal launch order.

    python examples/perf/ab_sm90_variants.py --set consumers --dims 64 [--seqlens 1024,4096,16384]
    python examples/perf/ab_sm90_variants.py --set order --causal 1 --passes fwd,fwdbwd
        [--dims 64,128] [--seqlens 1024,2048,4096,16384] [--rounds 3] [--json PATH]
    python examples/perf/ab_sm90_variants.py --set persistent [--causal 0,1] --dims 128,64
    python examples/perf/ab_sm90_variants.py --set dq_order --passes fwdbwd --causal 0,1
    python examples/perf/ab_sm90_variants.py --set dq_wait --passes fwdbwd --dims 128,64
    python examples/perf/ab_sm90_variants.py --set p_regs --passes fwdbwd --dims 128,64
    python examples/perf/ab_sm90_variants.py --set epilogue --causal 0,1 --dims 128,64
    python examples/perf/ab_sm90_variants.py --set order_bytes --causal 0,1 --dims 128
    python examples/perf/ab_sm90_variants.py --set stages --causal 0,1 --dims 128 --rounds 5
    python examples/perf/ab_sm90_variants.py --set wide --dims 160,192,256,192x128
        --seqlens 4096,16384 --causal 0,1 --passes fwdbwd --rounds 3 --warm 12

A variant set flips module settings in this process (`variants`):
- `consumers`: the sm_90 forward with two and with three consumer warpgroups
  (`_flash_fwd_sm90.CONSUMERS`), and the portable forward.
- `order`: causal launches interleaving (sequence, head) pairs longest-first (the default,
  `_common.CAUSAL_ORDER_L2_BYTES`) against one pair at a time (0), on the sm_90 kernels and on
  the portable ones (forward and backward paths pinned alike).
- `persistent`: the sm_90 forward with one tile per program and with the persistent grid
  (`_flash_fwd_sm90.PERSISTENT`, and `PERSISTENT_CAUSAL` for causal launches), and the portable
  forward.
- `dq_order`: the sm_90 backward issuing each step's dK product before dQ and after it
  (`_flash_bwd_sm90.DQ_BEFORE_DK`), and the portable backward.
- `dq_wait`: the sm_90 backward's consumers waiting for their previous dQ reduce at the step's
  start and just before the next store into its staging tile (`_flash_bwd_sm90.DQ_WAIT_LATE`),
  and the portable backward.
- `p_regs`: the sm_90 backward's dV product taking P^T from shared memory and from registers
  (`_flash_bwd_sm90.P_FROM_REGISTERS`), at d = 128 the latter also with three pipeline stages
  (`_flash_bwd_sm90.TILES`, which fit once P^T leaves shared memory), and the portable backward.
- `epilogue`: the sm_90 forward storing its output rows from registers and by TMA from shared
  memory (`_flash_fwd_sm90.TMA_EPILOGUE`), and the portable forward.
- `order_bytes`: the sm_90 kernels with `_common.CAUSAL_ORDER_L2_BYTES` at 16 MiB (the
  default), 0 (one pair at a time), 8, 32 and 64 MiB: how many (sequence, head) pairs' K and V
  the programs running at once stream, causal or not (the persistent grid deals its tiles in
  that order too).
- `stages`: the sm_90 forward with its K/V stages and TMA-stored output (the default), its
  output stored from registers, and that with one K/V stage more (`_flash_fwd_sm90.TILES`;
  at d = 128 the third stage takes the output staging's shared memory).
- `wide`: the sm_90 backward's 256-wide schedule (d = 160-256, `--dims 192x128` for d_qk x d_v)
  as it is (the variants `_flash_bwd_sm90.WIDE_DEFAULTS` runs at the dims) and with each of
  `WIDE_VARIANTS` flipped: turned off where the dims run it (`-no-`: the split ring at (192, 128),
  dV before dS^T at 160 and 192), turned on where it fits (`wide_variant_fits`) and they do not
  (`+`: dV before dS^T at 256, and beside the split ring at (192, 128)); cuDNN in the same
  process, as in every set.
To compare another variant, add its flip to `variants`. `--warm N` first compiles every
variant's kernels in N processes (a small problem each, the same specializations), so the
timed process finds them in Triton's cache instead of compiling one after another.

bf16, b = 16384 / s, h = 2048 / d (d_qk), inputs needing gradients as a training step has them. Each
variant's output (and, with `fwdbwd`, its gradients) is first checked against the first
variant's (relative error under 1e-2, else the row says WRONG and it is not timed). The providers
then run in `--rounds` interleaved rounds (`triton.testing.do_bench` medians), so a drift of the
GPU's clock reaches every provider alike, each round starting one provider later than the one
before (run as many rounds as there are providers, or a multiple, for each to take every
place); the table gives the median of the rounds. TFLOP/s count 2 b h s^2 (d_qk + d_v) forward
and 2.5x that forward+backward, halved when causal. A summary table at the end gives each
variant's time as a ratio to cuDNN's and to the first variant's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics

import torch
import torch.nn.functional as F
import triton
from fusedlayers.kernels import (
    _common,
    _flash_bwd_sm90,
    _flash_fwd_sm90,
    set_backward_path,
    set_forward_path,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusedlayers import flash_attn_func

TOKENS, HIDDEN = 16384, 2048
SAVED = {
    "consumers": dict(_flash_fwd_sm90.CONSUMERS),
    "order": _common.CAUSAL_ORDER_L2_BYTES,
    "persistent": dict(_flash_fwd_sm90.PERSISTENT),
    "persistent_causal": dict(_flash_fwd_sm90.PERSISTENT_CAUSAL),
    "tma_epilogue": dict(_flash_fwd_sm90.TMA_EPILOGUE),
    "fwd_tiles": dict(_flash_fwd_sm90.TILES),
}
# The sm_90 backward's per-head-dim switches a variant may flip, by `select` keyword.
BACKWARD_SWITCHES = {
    "dq_first": _flash_bwd_sm90.DQ_BEFORE_DK,
    "wait_late": _flash_bwd_sm90.DQ_WAIT_LATE,
    "p_regs": _flash_bwd_sm90.P_FROM_REGISTERS,
    "tile": _flash_bwd_sm90.TILES,
}
SAVED.update({name: dict(table) for name, table in BACKWARD_SWITCHES.items()})
SAVED["wide"] = dict(_flash_bwd_sm90.WIDE_DEFAULTS)


def timed(fn, grads=None) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")


def restore() -> None:
    _flash_fwd_sm90.CONSUMERS.update(SAVED["consumers"])
    _common.CAUSAL_ORDER_L2_BYTES = SAVED["order"]
    _flash_fwd_sm90.PERSISTENT.update(SAVED["persistent"])
    _flash_fwd_sm90.PERSISTENT_CAUSAL.update(SAVED["persistent_causal"])
    _flash_fwd_sm90.TMA_EPILOGUE.update(SAVED["tma_epilogue"])
    _flash_fwd_sm90.TILES.update(SAVED["fwd_tiles"])
    for name, table in BACKWARD_SWITCHES.items():
        table.update(SAVED[name])
    _flash_bwd_sm90.WIDE_DEFAULTS.update(SAVED["wide"])
    set_forward_path("auto")
    set_backward_path("auto")


def variants(which: str, d: int, d_v: int | None = None, causal: bool = True) -> dict:
    """name -> a function that selects that variant before a call; the first is the reference.
    The backward's tables are per tile width (`tile_width`; d itself at 64 and 128), its wide
    schedule's variants per (d, d_v) (`WIDE_DEFAULTS`)."""
    d_v = d if d_v is None else d_v
    width = _flash_bwd_sm90.tile_width(d)

    def select(
        path, consumers=None, order=None, persistent=None, tma_epilogue=None, fwd_stages=None,
        wide=None, **backward,
    ):  # fmt: skip
        def apply():
            restore()
            set_forward_path(path)
            set_backward_path(path)
            if consumers is not None:
                _flash_fwd_sm90.CONSUMERS[d] = consumers
            if order is not None:
                _common.CAUSAL_ORDER_L2_BYTES = order
            if persistent is not None:
                _flash_fwd_sm90.PERSISTENT[d] = persistent
                _flash_fwd_sm90.PERSISTENT_CAUSAL[d] = persistent
            if tma_epilogue is not None:
                _flash_fwd_sm90.TMA_EPILOGUE[d] = tma_epilogue
            if fwd_stages is not None:
                _flash_fwd_sm90.TILES[d] = (_flash_fwd_sm90.TILES[d][0], fwd_stages)
            for name, value in backward.items():
                BACKWARD_SWITCHES[name][width] = value
            if wide is not None:  # the wide schedule's variants to run at (d, d_v)
                _flash_bwd_sm90.WIDE_DEFAULTS[(d, d_v)] = wide

        return apply

    if which == "wide":  # the default, then each variant flipped
        on = SAVED["wide"].get((d, d_v), ())
        chosen = {"sm90": select("sm90")}
        for name in _flash_bwd_sm90.WIDE_VARIANTS:
            if name in on:
                chosen[f"sm90-no-{name}"] = select("sm90", wide=tuple(n for n in on if n != name))
            elif _flash_bwd_sm90.wide_variant_fits(name, d, d_v):
                chosen[f"sm90+{name}"] = select("sm90", wide=(*on, name))
        return chosen

    if which == "consumers":
        return {
            "portable": select("portable"),
            "sm90-2wg": select("sm90", consumers=2),
            "sm90-3wg": select("sm90", consumers=3),
        }
    if which == "persistent":
        return {
            "portable": select("portable"),
            "sm90-per-tile": select("sm90", persistent=False),
            "sm90-persistent": select("sm90", persistent=True),
        }
    if which == "epilogue":
        return {
            "portable": select("portable"),
            "sm90-stores": select("sm90", tma_epilogue=False),
            "sm90-tma-store": select("sm90", tma_epilogue=True),
        }
    if which == "stages":
        stages = SAVED["fwd_tiles"][d][1]
        return {
            "portable": select("portable"),
            "sm90-tma-store": select("sm90"),
            "sm90-stores": select("sm90", tma_epilogue=False),
            f"sm90-stores-{stages + 1}-stages": select(
                "sm90", tma_epilogue=False, fwd_stages=stages + 1
            ),
        }
    if which == "dq_order":
        return {
            "portable": select("portable"),
            "sm90-dk-first": select("sm90", dq_first=False),
            "sm90-dq-first": select("sm90", dq_first=True),
        }
    if which == "p_regs":
        block_m = _flash_bwd_sm90.TILES[d][0]
        chosen = {
            "portable": select("portable"),
            "sm90-p-smem": select("sm90", p_regs=False, tile=(block_m, 2)),
            "sm90-p-regs": select("sm90", p_regs=True, tile=(block_m, 2)),
        }
        if d == 128:  # d = 64's 128-row step has no room for a third stage either way
            chosen["sm90-p-regs-3-stages"] = select("sm90", p_regs=True, tile=(block_m, 3))
        return chosen
    if which == "dq_wait":
        return {
            "portable": select("portable"),
            "sm90-wait-at-start": select("sm90", wait_late=False),
            "sm90-wait-before-store": select("sm90", wait_late=True),
        }
    if which == "order_bytes":
        return {
            "sm90 (16 MiB)": select("sm90"),
            "sm90-pairwise": select("sm90", order=0),
            "sm90-8MiB": select("sm90", order=8 << 20),
            "sm90-32MiB": select("sm90", order=32 << 20),
            "sm90-64MiB": select("sm90", order=64 << 20),
        }
    return {
        "portable-pairwise": select("portable", order=0),
        "portable": select("portable"),
        "sm90-pairwise": select("sm90", order=0),
        "sm90": select("sm90"),
    }


def _inputs(b: int, s: int, h: int, d: int, d_v: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(
            b, s, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen
        ).requires_grad_()
        for dim in (d, d, d_v)
    )
    dout = torch.randn(b, s, h, d_v, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, dout


def _warm_one(job) -> str:
    """Compile (by running once, small) one variant's kernels into Triton's on-disk cache: the
    same head counts as the timed problem, so the same specializations."""
    which, d, d_v, causal, name = job
    try:
        variants(which, d, d_v, causal)[name]()
        q, k, v, dout = _inputs(1, 1024, HIDDEN // d, d, d_v)
        flash_attn_func(q, k, v, causal=causal).backward(dout)
        torch.cuda.synchronize()
        return f"warm {name} d={d}x{d_v} causal={int(causal)}: ok"
    except Exception as e:  # reported; the timed run meets it again and says WRONG or fails
        return f"warm {name} d={d}x{d_v} causal={int(causal)}: {type(e).__name__}: {e}"
    finally:
        restore()


def warm(which: str, cells: list, workers: int) -> None:
    """Every (variant, dims, causal) of `cells` compiled in `workers` processes at once."""
    jobs = [
        (which, d, d_v, causal, name)
        for d, d_v, causal in cells
        for name in variants(which, d, d_v, causal)
    ]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for line in pool.imap_unordered(_warm_one, jobs):
            print(line, flush=True)


def measure(
    which: str, d: int, s: int, causal: bool, passes: list[str], rounds: int,
    d_v: int | None = None,
) -> dict:  # fmt: skip
    d_v = d if d_v is None else d_v
    b, h = TOKENS // s, HIDDEN // d
    q, k, v, dout = _inputs(b, s, h, d, d_v)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    grads = [q, k, v]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

    def ours():
        return flash_attn_func(q, k, v, causal=causal)

    def both(fn):
        return lambda: fn().backward(dout)

    chosen = variants(which, d, d_v, causal)
    backward = "fwdbwd" in passes

    def result(apply):
        apply()
        out = ours()
        if not backward:
            return [out.detach().float()]
        return [t.float() for t in (out.detach(), *torch.autograd.grad(out, grads, dout))]

    errors, wrong, reference = {}, set(), None
    for name, apply in chosen.items():
        got = result(apply)
        reference = reference or got
        errors[name] = max(((g - r).norm() / r.norm()).item() for g, r in zip(got, reference))
        if not errors[name] < 1e-2:
            wrong.add(name)

    providers = {name: (apply, ours) for name, apply in chosen.items() if name not in wrong}
    providers["cudnn"] = (restore, cudnn)
    runs = {(name, p): [] for name in providers for p in passes}
    names = list(providers)
    for r in range(rounds):
        # Each round starts one provider later: timed in the same place every round, identical
        # kernels read up to 2% apart (docs/performance.md, "The forward's softmax and the P V
        # product").
        for name in names[r % len(names) :] + names[: r % len(names)]:
            apply, fn = providers[name]
            apply()
            for p in passes:
                runs[(name, p)].append(timed(fn if p == "fwd" else both(fn), grads))
    restore()
    flops = 2 * b * h * s * s * (d + d_v) / (2 if causal else 1)
    row = {"d": d, "d_v": d_v, "s": s, "causal": int(causal), "errors": errors,
           "wrong": sorted(wrong)}  # fmt: skip
    for (name, p), rs in runs.items():
        ms = statistics.median(rs)
        work = flops * (2.5 if p == "fwdbwd" else 1.0)
        row[f"{name}/{p}"] = {"ms": ms, "tflops": work / ms / 1e9, "rounds_ms": rs}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sets = (
        "consumers",
        "order",
        "order_bytes",
        "persistent",
        "epilogue",
        "stages",
        "dq_order",
        "dq_wait",
        "p_regs",
        "wide",
    )
    parser.add_argument("--set", choices=sets, default="consumers")
    parser.add_argument("--dims", default="64")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--causal", default="0,1", help="which of 0 (no mask) and 1 to run")
    parser.add_argument("--passes", default="fwd", help="fwd, fwdbwd or both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--warm", type=int, default=0, help="compile the variants first in this many processes"
    )
    args = parser.parse_args()
    passes = args.passes.split(",")
    dims = []
    for spec in args.dims.split(","):  # "192" or "192x128" (d_qk x d_v)
        d, _, d_v = spec.partition("x")
        dims.append((int(d), int(d_v or d)))
    seqlens = [int(x) for x in args.seqlens.split(",")]
    causals = [bool(int(x)) for x in args.causal.split(",")]
    print(
        torch.cuda.get_device_name(), torch.__version__, triton.__version__,
        f"cuDNN {torch.backends.cudnn.version()}", f"variants: {args.set}", flush=True,
    )  # fmt: skip
    if args.warm:
        warm(args.set, [(d, d_v, c) for d, d_v in dims for c in causals], args.warm)
    rows = []
    try:
        for d, d_v in dims:
            for s in seqlens:
                for causal in causals:
                    row = measure(args.set, d, s, causal, passes, args.rounds, d_v)
                    rows.append(row)
                    cells = [
                        f"{key} {val['tflops']:.0f}"
                        for key, val in row.items()
                        if isinstance(val, dict) and "tflops" in val
                    ]
                    errors = " ".join(f"{n}={e:.1e}" for n, e in row["errors"].items())
                    wrong = f" WRONG: {row['wrong']}" if row["wrong"] else ""
                    print(
                        f"d={d}x{d_v} s={s} causal={int(causal)} | " + " | ".join(cells)
                        + f" | err vs first: {errors}{wrong}", flush=True,
                    )  # fmt: skip
    finally:
        restore()
    summary(rows, passes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def summary(rows: list, passes: list[str]) -> None:
    """Per pass, one line a cell: each variant's time as cuDNN's over its own (x cuDNN, higher
    is faster) and as a ratio to the first variant's (vs first, above 1 is faster)."""
    for p in passes:
        names = []
        for row in rows:
            for key in row:
                name, _, kind = key.rpartition("/")
                if kind == p and name != "cudnn" and name not in names:
                    names.append(name)
        if not names:
            continue
        print(f"\n{p}: x cuDNN (vs {names[0]})")
        print("| cell | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for row in rows:
            cudnn = row.get(f"cudnn/{p}", {}).get("ms")
            first = row.get(f"{names[0]}/{p}", {}).get("ms")
            cells = []
            for name in names:
                ms = row.get(f"{name}/{p}", {}).get("ms")
                if ms is None:
                    cells.append("WRONG" if name in row["wrong"] else "-")
                    continue
                vs = f" ({first / ms:.3f})" if first else ""
                cells.append((f"{cudnn / ms:.2f}x" if cudnn else "?") + vs)
            label = f"d={row['d']}x{row['d_v']} s={row['s']} c={row['causal']}"
            print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
