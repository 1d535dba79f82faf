"""The attention benchmark: fusedlayers against PyTorch SDPA (flash, cuDNN, efficient) and
FlexAttention, side by side in one process on one GPU (anchors.md: claims are ratios measured
that way).

    python -m fusedlayers.bench attention --quick       # the headline cells, about 2 minutes
    python -m fusedlayers.bench attention               # every case, under 10 minutes on an H100
    python -m fusedlayers.bench attention --full --dtypes bf16 --dims 64 --out bench-out/d64

Each shape is checked against an SDPA reference before it is timed; a provider that fails the
check or raises is reported as such, never timed silently. Writes attention.json to --out after
every case (a run cut short keeps what it measured), then the TFLOP/s plots, and prints the
summary table last. `python -m fusedlayers.bench report --bench-dir DIR` renders a whole page
from it.
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
    configure_dynamo,
    csv_arg,
    failure,
    finish_row,
    ints_arg,
    measure_runner,
    progress_lines,
    random_lengths,
    short_error,
)
from .record import read_run, run_header, write_run

TOKENS = 16384  # b * s for every shape: the same work per row, as anchors.md measures
HIDDEN = 2048  # h * d
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
# against the three anchors, with a shorter do_bench. Not yet timed on a GPU; estimated from the
# per-case times of run 19 (bench/attention.json: the same 8 cases took 104 s with six providers
# and 12 timings of 100 ms each, 7-17 s a case, mostly compilation and autotuning). Dropping the
# portable pin and SDPA's efficient backend and timing 8 passes for 30 ms should save about 3 s a
# case: 80 s of cases, plus about 10 s of cold compiles in the first case and 10 s of start-up.
# The s = 1k cases would add about 65 s (`--quick --seqlens 1024,4096,16384` runs them). No case
# starts after 90 s, so a slower machine drops the last cells rather than running long.
QUICK_ESTIMATE = "about 100 s on an H100 (estimated from earlier runs, not yet timed)"
PRESETS = {
    "quick": {
        "dtypes": ["bf16"],
        "dims": [64, 128],
        "seqlens": [4096, 16384],
        "cases": ["sweep"],
        "providers": ["fusedlayers", "sdpa-flash", "sdpa-cudnn", "flex"],
        "warmup": 10,
        "rep": 30,
        "time_limit": 90.0,
    },
    "standard": {
        "dtypes": ["bf16"],
        "dims": [64, 128],
        "seqlens": [1024, 4096, 16384],
        "cases": list(CASES),
        "providers": list(PROVIDERS),
        "warmup": 25,
        "rep": 100,
        "time_limit": 480.0,
    },
    "full": {
        "dtypes": ["bf16", "fp16"],
        "dims": [64, 128, 256],
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


def build_cases(args: argparse.Namespace) -> list[Case]:
    """Sweep shapes, then the extra cases, per dtype (the order they run and are reported in)."""
    es, h = args.extra_seqlen, HIDDEN // EXTRA_DIM
    lengths = random_lengths(TOKENS, random.Random(args.seed), max(1, TOKENS // 128), TOKENS // 4)
    cases = []
    for dtype in args.dtypes:
        if "sweep" in args.cases:
            for d, s, c in itertools.product(args.dims, args.seqlens, args.causal):
                cases.append(Case("sweep", dtype, d, TOKENS // s, HIDDEN // d, HIDDEN // d, s, c))
        for c in args.causal:
            if "gqa" in args.cases:
                hq, hkvs = GQA_HEADS
                cases += [Case("gqa", dtype, EXTRA_DIM, TOKENS // es, hq, g, es, c) for g in hkvs]
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
    row = {k: getattr(case, k) for k in ("kind", "dtype", "d", "b", "hq", "hkv", "causal")}
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
            "cells: TFLOP/s, forward 4*b*h_q*s_q*s_k*d, halved for square causal; windows and "
            "varlen count visible pairs exactly; fwdbwd = 3.5x forward; each provider counts its "
            "own work",
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
    preset.add_argument("--full", action="store_true", help="bf16,fp16; d 64,128,256; s 512..16k")
    p.add_argument(
        "--providers", type=csv_arg(PROVIDERS), help=f"{','.join(PROVIDERS)} (preset: all)"
    )
    p.add_argument("--dtypes", type=csv_arg(list(DTYPES)), help="overrides the preset")
    p.add_argument("--dims", type=ints_arg, help="head dims dividing 2048 (h = 2048/d)")
    p.add_argument("--seqlens", type=ints_arg, help="seqlens dividing 16384 (b = 16384/s)")
    p.add_argument("--passes", type=csv_arg(PASSES), default=list(PASSES), help="fwd,fwdbwd")
    p.add_argument("--causal", type=csv_arg(("0", "1")), default=["0", "1"], help="0,1")
    p.add_argument("--cases", type=csv_arg(CASES), help=f"{','.join(CASES)} (preset: all)")
    p.add_argument("--extra-seqlen", type=int, default=4096, help="s of the gqa, packed cases")
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
    args.preset = "full" if args.full else "quick" if args.quick else "standard"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:  # explicit flags win over the preset
            setattr(args, key, value)
    args.causal = [c == "1" for c in args.causal]
    for flag, values, total in (("seqlens", args.seqlens, TOKENS), ("dims", args.dims, HIDDEN)):
        if any(x <= 0 or total % x for x in values):
            p.error(f"--{flag} {values}: each must divide {total}")
    if args.extra_seqlen <= 0 or TOKENS % args.extra_seqlen:
        p.error(f"--extra-seqlen {args.extra_seqlen}: must divide {TOKENS}")
    return args


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
