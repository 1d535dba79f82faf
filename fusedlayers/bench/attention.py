"""The attention benchmark: fusedlayers against PyTorch SDPA (flash, cuDNN, efficient) and
FlexAttention, side by side in one process on one GPU (anchors.md: claims are ratios measured
that way).

    python -m fusedlayers.bench attention --quick       # the headline cells, 107 s on an H200
    python -m fusedlayers.bench attention               # every case, under 10 minutes on an H100
    python -m fusedlayers.bench attention --head-dims   # d 64..256 and 192x128, GQA 32/8, 4k-16k
    python -m fusedlayers.bench attention --full --dtypes bf16 --dims 64 --out bench-out/d64

--head-dims stops starting cases after 420 s (about 8 minutes a run, an estimate); its 54 cases
take about 12, so two runs cover them all, joined by --merge:

    python -m fusedlayers.bench attention --head-dims --dims 64,80,96,128 --out bench-out/dims-a
    python -m fusedlayers.bench attention --head-dims --dims 160,192,256,192x128 --cases sweep \\
        --out bench-out/dims-b
    python -m fusedlayers.bench attention --out bench-out/dims \\
        --merge bench-out/dims-a/attention.json bench-out/dims-b/attention.json

Every sweep shape has b*s = 16384 tokens and h*d = 2048; where d_qk does not divide 2048 it runs
h = round(2048/d_qk) heads, and TFLOP/s count what runs. `--dims 64,192x128` names head dims;
`AxB` is d_qk A with d_v B. Each shape is checked against an SDPA reference before it is timed;
a provider that fails the check or raises is reported as such, never timed silently, and one
with no kernel for the shape (SDPA-flash on d_v != d_qk) is reported unsupported, with SDPA's
reason. Writes attention.json to --out after every case (a run cut short keeps what it
measured), then the TFLOP/s plots, and prints the summary table last.
`python -m fusedlayers.bench report --bench-dir DIR` renders a whole page from it.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

import torch

from . import plots, tables
from .attention_cases import DTYPES, SETUPS, Case, Setup
from .common import (
    FatalCudaError,
    Reference,
    Unsupported,
    configure_dynamo,
    csv_arg,
    failure,
    finish_row,
    head_dims_arg,
    ints_arg,
    measure_runner,
    progress_lines,
    random_lengths,
    short_error,
    unsupported,
)
from .record import read_run, run_header, write_run

TOKENS = 16384  # b * s for every shape: the same work per row, as anchors.md measures
HIDDEN = 2048  # h * d (h = round(HIDDEN / d) where d does not divide it: see heads_for)
# fusedlayers-portable: the same call pinned to the portable Triton forward kernel, which on
# sm_90 GPUs is otherwise replaced by the warp-specialized one where that covers the call.
PROVIDERS = (
    "fusedlayers",
    "fusedlayers-portable",
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
    "flex",
)
CASES = ("sweep", "gqa", "varlen", "packed", "window")
PASSES = ("fwd", "fwdbwd")
# --quick: the cells the summary reads (s >= 4k, both head dims, causal and not, both passes)
# against the three anchors, with a shorter do_bench. Timed: its 8 cases took 107 s wall on a
# fresh H200 (cold Triton cache, torch 2.11, Triton 3.6, 2026-11-28), most of it compilation and
# autotuning (split by estimate, not measured: about 20 s of start-up and first-case cold
# compiles, then about 11 s a case). The s = 1k cases would add about 65 s (an earlier estimate;
# `--quick --seqlens 1024,4096,16384` runs them). No case starts after 90 s, so a slower machine
# drops the last cells rather than running long.
QUICK_ESTIMATE = (
    "107 s wall on a fresh H200 (cold Triton cache, torch 2.11, Triton 3.6, 2026-11-28)"
)
# --head-dims: the head-dim cells (d 64, 80, 96, 128, 160, 192, 256 and d_qk 192 with d_v 128 at
# s = 4k, 8k, 16k, causal and not: 48 cases) and GQA 32/8 at d = 128 at the same lengths (6
# cases), against the three anchors with quick's do_bench. An ESTIMATE, not yet timed: at quick's
# rate (about 11 s a case after 20 s of start-up) plus about 10 s of cold compiles and
# autotuning for each new head dim, the 54 cases take about 54 x 11 + 8 x 10 + 20 = 700 s, some
# 12 minutes on an H100. The 420 s time limit keeps one run near 8 minutes (the limit, the case
# running at it, the plots): it measures about the first 30 cases (d = 64 to 160 and some of
# 192) and names the others in the run's header (`not_run`). Two runs of about 6-7 minutes each
# cover every cell (the module docstring's commands; --merge joins them).
HEAD_DIMS_ESTIMATE = (
    "estimated 8 minutes on an H100 for about 30 of its 54 cases; all of them in two runs: "
    "--dims 64,80,96,128 and --dims 160,192,256,192x128 --cases sweep, then --merge"
)
ANCHORS = ["fusedlayers", "sdpa-flash", "sdpa-cudnn", "flex"]
PRESETS = {
    "quick": {
        "dtypes": ["bf16"],
        "dims": head_dims_arg("64,128"),
        "seqlens": [4096, 16384],
        "cases": ["sweep"],
        "providers": ANCHORS,
        "warmup": 10,
        "rep": 30,
        "time_limit": 90.0,
    },
    "head-dims": {
        "dtypes": ["bf16"],
        "dims": head_dims_arg("64,80,96,128,160,192,256,192x128"),
        "seqlens": [4096, 8192, 16384],
        "cases": ["sweep", "gqa"],
        "gqa_seqlens": [4096, 8192, 16384],
        "gqa_kv_heads": [8],
        "providers": ANCHORS,
        "warmup": 10,
        "rep": 30,
        "time_limit": 420.0,
    },
    "standard": {
        "dtypes": ["bf16"],
        "dims": head_dims_arg("64,128"),
        "seqlens": [1024, 4096, 16384],
        "cases": list(CASES),
        "providers": list(PROVIDERS),
        "warmup": 25,
        "rep": 100,
        "time_limit": 480.0,
    },
    "full": {
        "dtypes": ["bf16", "fp16"],
        "dims": head_dims_arg("64,128,256"),
        "seqlens": [512, 1024, 2048, 4096, 8192, 16384],
        "cases": list(CASES),
        "providers": list(PROVIDERS),
        "warmup": 25,
        "rep": 100,
        "time_limit": 480.0,
    },
}
# Norm-wise relative error allowed against the reference. Two correct kernels differ by output
# rounding (2^-9 for bf16, 2^-12 for fp16) amplified a little in the gradients: a few 1e-3 in
# bf16. A wrong tile, mask or stride gives 1e-1 or more.
TOLERANCE = {"bf16": 3e-2, "fp16": 1e-2}
GQA_HEADS = (32, (8, 1))  # query heads, KV heads per case
EXTRA_DIM = 128
WINDOW_SEQLEN, WINDOW = 16384, (4096, 0)


def heads_for(d_qk: int) -> int:
    """Query heads of a sweep shape with head dim `d_qk`: HIDDEN / d_qk where that divides, else
    the nearest whole count (80 -> 26, 192 -> 11), at least 1. TFLOP/s count the heads that run."""
    return max(1, round(HIDDEN / d_qk))


def build_cases(args: argparse.Namespace) -> list[Case]:
    """Sweep shapes, then the extra cases, per dtype (the order they run and are reported in).
    `args.dims` holds (d_qk, d_v) pairs."""
    es, h = args.extra_seqlen, HIDDEN // EXTRA_DIM
    lengths = random_lengths(TOKENS, random.Random(args.seed), max(1, TOKENS // 128), TOKENS // 4)
    cases = []
    for dtype in args.dtypes:
        if "sweep" in args.cases:
            for (d, d_v), s, c in itertools.product(args.dims, args.seqlens, args.causal):
                hq = heads_for(d)
                cases.append(Case("sweep", dtype, d, TOKENS // s, hq, hq, s, c, d_v=d_v))
        for c in args.causal:
            if "gqa" in args.cases:
                hq = GQA_HEADS[0]
                cases += [
                    Case("gqa", dtype, EXTRA_DIM, TOKENS // s, hq, g, s, c)
                    for s in args.gqa_seqlens
                    for g in args.gqa_kv_heads
                ]
            if "varlen" in args.cases:
                n, top = len(lengths), max(lengths)
                cases.append(Case("varlen", dtype, EXTRA_DIM, n, h, h, top, c, lengths=lengths))
            if "packed" in args.cases:
                cases.append(Case("packed", dtype, EXTRA_DIM, TOKENS // es, h, h, es, c))
        if "window" in args.cases:
            b, s = TOKENS // WINDOW_SEQLEN, WINDOW_SEQLEN
            cases.append(Case("window", dtype, EXTRA_DIM, b, h, h, s, True, window=WINDOW))
    return cases


# ----------------------------------------------------------------------------- running


def _new_row(case: Case, setup: Setup, pass_: str) -> dict:
    keys = ("kind", "dtype", "d", "d_v", "b", "hq", "hkv", "causal")
    row = {k: getattr(case, k) for k in keys}
    row["case"] = row.pop("kind")
    row |= {"s_q": case.s, "s_k": case.s, "pass": pass_, "subject": setup.subject}
    row["window"] = list(case.window) if case.window else None
    row["tokens"] = sum(case.lengths) if case.lengths else case.b * case.s
    row["seqs"] = len(case.lengths) if case.lengths else case.b
    row |= {"mem_baseline": setup.mem_baseline, "notes": list(setup.notes), "providers": {}}
    return row


def _forward_picks() -> dict:
    """The forward autotuner's picks so far ({launch signature: config}); {} without the kernels."""
    try:
        from fusedlayers.kernels import _flash_fwd
    except Exception:  # a broken install still lets the competitors be measured
        return {}
    return dict(_flash_fwd._PICKED)


def _forward_timings():
    """The forward autotuner's latest candidate timings (a new dict after each tuning run)."""
    try:
        from fusedlayers.kernels import _flash_fwd
    except Exception:
        return None
    return getattr(_flash_fwd._attn_fwd, "configs_timings", None)


_NOT_TAKEN = object()


def autotune_note(name: str, before: dict, timings_before=_NOT_TAKEN) -> str:
    """Names the forward configs provider `name` autotuned since `before` (a `_forward_picks()`),
    with the candidates' times the autotuner measured: a pick made on a noisy measurement then
    shows in the report next to the row it slows down. `timings_before` (a `_forward_timings()`
    taken with `before`) tells a pick the autotuner measured from one it answered from its cache
    (its key ignores strides, so a new layout of a tuned shape is a new pick but no new timing)."""
    try:
        return _autotune_note(name, before, timings_before)
    except Exception as error:  # diagnostics must never cost the row its measurements
        return f"{name}: no autotune note ({short_error(error)})"


def _autotune_note(name: str, before: dict, timings_before) -> str:
    picked = [c for key, c in _forward_picks().items() if key not in before]
    if not picked:
        return ""

    def label(config) -> str:
        kw = config.kwargs
        return f"({kw['BLOCK_M']}, {kw['BLOCK_N']}, {config.num_warps}, {config.num_stages})"

    picks = ", ".join(label(c) for c in picked)
    timings = _forward_timings()
    if timings_before is not _NOT_TAKEN and timings is timings_before:
        return f"{name}: forward picked {picks} from the autotuner's cache (no new timing)"
    measured = ", ".join(f"{label(c)} {t[0]:.3f} ms" for c, t in (timings or {}).items() if t)
    return f"{name}: forward autotuned here to {picks}" + (
        f" (last autotune measured {measured})" if measured else ""
    )


def run_case(case: Case, args: argparse.Namespace) -> list[dict]:
    """Build, check and time every provider of one case; one row per pass."""
    setup = SETUPS[case.kind](case, lambda name: name in args.providers)
    rows = {p: _new_row(case, setup, p) for p in args.passes}
    refs: dict[str, Reference] = {}  # computed once per case, when a provider first needs one
    for name, factory in setup.factories.items():
        try:
            runner = factory()
            if runner.ref not in refs:
                refs[runner.ref] = setup.refs[runner.ref]("fwdbwd" in args.passes)
            ref = refs[runner.ref]
            before, timings_before = _forward_picks(), _forward_timings()
            results = measure_runner(runner, ref, TOLERANCE[case.dtype], args)
            tuned = autotune_note(name, before, timings_before)
            notes = [n for n in (runner.note, f"checked against {ref.name}", tuned) if n]
        except FatalCudaError:
            raise
        except Unsupported as refusal:  # no kernel for this shape: the reason, no timing
            results, notes = {p: unsupported(refusal) for p in args.passes}, []
        except Exception as error:  # a failing provider is a table entry, never a crash
            results, notes = {p: failure(error) for p in args.passes}, []
        for pass_, result in results.items():
            rows[pass_]["providers"][name] = result
            rows[pass_]["notes"] += [n for n in notes if n not in rows[pass_]["notes"]]
        runner = None  # drop this provider's tensors before the next one allocates
        torch.cuda.empty_cache()
    return [finish_row(rows[p]) for p in args.passes]


def _progress_bar(total: int):
    """A tqdm bar over the cases, or None without tqdm (the `examples` extra installs it)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="case", dynamic_ncols=True, file=sys.stderr)


def run_all(args: argparse.Namespace, header: dict) -> list[dict]:
    """Every case in order, writing the run after each so a killed run keeps what it did."""
    rows: list[dict] = []
    cases, start = build_cases(args), time.monotonic()
    bar = _progress_bar(len(cases)) if args.progress else None
    for i, case in enumerate(cases):
        if time.monotonic() - start > args.time_limit:
            left = "; ".join(c.label for c in cases[i:])
            header["not_run"] = f"time limit: {len(cases) - i} cases: {left[:2000]}"
            _say(bar, f"time limit {args.time_limit:.0f}s reached: {len(cases) - i} cases not run")
            break
        if bar is not None:
            bar.set_description(case.label)
        torch.manual_seed(args.seed + i)  # fresh random data per case, reproducible per run
        try:
            case_rows = run_case(case, args)
        except FatalCudaError as error:
            header["aborted"] = f"{case.label}: CUDA context lost: {error}"
            _say(bar, header["aborted"])
            break
        rows += case_rows
        lines = progress_lines(case.label, case_rows, time.monotonic() - start)
        if bar is not None:
            bar.update(1)
        _say(bar, "\n".join(lines if args.verbose else lines[:1]) + f"  ({i + 1}/{len(cases)})")
        write_run(Path(args.out) / "attention.json", "attention", header, rows)
    if bar is not None:
        bar.close()
    return rows


def _say(bar, text: str) -> None:
    """A line under the progress bar (or on stdout without one)."""
    if bar is not None:
        bar.write(text)
    else:
        print(text, flush=True)


def attention_header(args: argparse.Namespace) -> dict:
    """The run's provenance (fusedlayers.bench.record) with the matmul gate, and the method."""
    return run_header(
        gate=True,
        warmup=args.warmup,
        rep=args.rep,
        config={
            "preset": args.preset,
            "warmup_ms": args.warmup,
            "rep_ms": args.rep,
            "tolerance": TOLERANCE,
            "tokens": TOKENS,
            "hidden": HIDDEN,
        },
        method=[
            f"time: triton.testing.do_bench median (warmup {args.warmup} ms, rep {args.rep} ms, "
            "L2 flushed before each run); inputs require grad in both passes; fwdbwd = forward "
            "+ backward of a random dout, grads set to None before each run",
            "cells: TFLOP/s, forward 2*b*h_q*s_q*s_k*(d_qk + d_v) (4*b*h_q*s_q*s_k*d when "
            "d_v = d), halved for square causal; windows and varlen count visible pairs exactly; "
            "fwdbwd = 3.5x forward (1 + (3*d_qk + 2*d_v)/(d_qk + d_v) when d_v != d_qk); each "
            "provider counts its own work",
            "ratios[X] = time of X / time of the subject for the same job (> 1: subject faster)",
            "mem MiB: peak max_memory_allocated over the live inputs for one call of the pass "
            "(grads included); mem_flag: subject > baseline + 10%",
            "checked once per shape (output, and dq/dk/dv when fwdbwd runs) against SDPA: "
            f"rel err over {TOLERANCE} = WRONG, not timed",
        ],
    )


def finish(args: argparse.Namespace, header: dict, rows: list[dict]) -> str:
    """Write the run and its plots to --out; return the summary and table to print."""
    out = Path(args.out)
    write_run(out / "attention.json", "attention", header, rows)
    lines = [f"wrote {out / 'attention.json'}"]
    try:
        lines += [f"wrote {p}" for p in ([] if args.no_plot else plots.attention_plots(rows, out))]
    except ImportError as error:  # the measurements are written; only the pictures are missing
        lines.append(f"plots skipped ({error}): pip install matplotlib")
    lines += ["", *tables.attention_summary(rows), "", *tables.attention_sweep(rows)]
    other = tables.attention_other(rows)
    if other:
        lines += ["", *other]
    return "\n".join(lines)


def merge_runs(paths: list[str]) -> tuple[dict, list[dict]]:
    """Join the attention.json of several runs (a sweep split to fit a time limit): the first
    run's header with every run's command, the rows in order."""
    runs = [read_run(p) for p in paths]
    header = dict(runs[0]["header"])
    header["command"] = " ; ".join(r["header"].get("command", "?") for r in runs)
    return header, [row for r in runs for row in r["rows"]]


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fusedlayers.bench attention",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    preset = p.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick",
        action="store_true",
        help="bf16; d 64,128; s 4k,16k; sweep only; fusedlayers, SDPA-flash, cuDNN, Flex; "
        f"do_bench 10/30 ms; {QUICK_ESTIMATE}",
    )
    preset.add_argument(
        "--head-dims",
        action="store_true",
        help="bf16; d 64,80,96,128,160,192,256,192x128; s 4k,8k,16k; sweep and GQA 32/8 at "
        f"d 128; the anchors as --quick; {HEAD_DIMS_ESTIMATE}",
    )
    preset.add_argument("--full", action="store_true", help="bf16,fp16; d 64,128,256; s 512..16k")
    p.add_argument(
        "--providers", type=csv_arg(PROVIDERS), help=f"{','.join(PROVIDERS)} (preset: all)"
    )
    p.add_argument("--dtypes", type=csv_arg(list(DTYPES)), help="overrides the preset")
    p.add_argument(
        "--dims",
        type=head_dims_arg,
        help="head dims, D or DQKxDV (d_qk DQK, d_v DV), e.g. 64,128,192x128; h = round(2048/d_qk)",
    )
    p.add_argument("--seqlens", type=ints_arg, help="seqlens dividing 16384 (b = 16384/s)")
    p.add_argument("--passes", type=csv_arg(PASSES), default=list(PASSES), help="fwd,fwdbwd")
    p.add_argument("--causal", type=csv_arg(("0", "1")), default=["0", "1"], help="0,1")
    p.add_argument("--cases", type=csv_arg(CASES), help=f"{','.join(CASES)} (preset: all)")
    p.add_argument("--extra-seqlen", type=int, default=4096, help="s of the gqa, packed cases")
    p.add_argument(
        "--gqa-seqlens", type=ints_arg, help="s of the gqa case (preset: --extra-seqlen)"
    )
    p.add_argument(
        "--gqa-kv-heads", type=ints_arg, help="KV heads of the gqa case, of 32 (preset: 8,1)"
    )
    p.add_argument("--warmup", type=int, help="do_bench warm-up, ms (preset: 25)")
    p.add_argument("--rep", type=int, help="do_bench repetition time, ms (preset: 100)")
    p.add_argument("--time-limit", type=float, help="s; no case starts after it (preset: 480)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out", help="directory for attention.json and plots")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    p.add_argument("--verbose", action="store_true", help="every provider's result per case")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join earlier runs' attention.json")
    args = p.parse_args(argv)
    args.preset = _preset_name(args)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:  # explicit flags win over the preset
            setattr(args, key, value)
    args.gqa_seqlens = args.gqa_seqlens or [args.extra_seqlen]
    args.gqa_kv_heads = args.gqa_kv_heads or list(GQA_HEADS[1])
    args.causal = [c == "1" for c in args.causal]
    for flag, values in (("seqlens", args.seqlens), ("gqa-seqlens", args.gqa_seqlens)):
        if any(x <= 0 or TOKENS % x for x in values):
            p.error(f"--{flag} {values}: each must divide {TOKENS}")
    if args.extra_seqlen <= 0 or TOKENS % args.extra_seqlen:
        p.error(f"--extra-seqlen {args.extra_seqlen}: must divide {TOKENS}")
    if any(g <= 0 or GQA_HEADS[0] % g for g in args.gqa_kv_heads):
        p.error(f"--gqa-kv-heads {args.gqa_kv_heads}: each must divide {GQA_HEADS[0]}")
    return args


def _preset_name(args: argparse.Namespace) -> str:
    """The PRESETS key the preset flags pick (standard without one)."""
    for name in ("full", "quick", "head-dims"):
        if getattr(args, name.replace("-", "_")):
            return name
    return "standard"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        header, rows = merge_runs(args.merge)
        print(finish(args, header, rows))
        return 0
    if not torch.cuda.is_available():
        print("the attention benchmark needs a CUDA GPU (--merge joins earlier runs on any)")
        return 2
    configure_dynamo()
    header = attention_header(args)
    versions = ", ".join(f"{k} {header[k]}" for k in ("torch", "triton", "cudnn") if k in header)
    print(f"{header['gpu']} | {versions} | bf16 matmul {header.get('matmul_tflops')} TFLOP/s")
    rows = run_all(args, header)
    print(finish(args, header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
