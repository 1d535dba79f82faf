"""Helpers shared by the example benchmark scripts (examples/ and examples/perf/).

The measuring code lives in the package, `fusedlayers.bench` (FLOP counts, do_bench timing, the
correctness check, the run header and its JSON): the names below are re-exported from there so
the scripts keep one import line. What is defined here serves only the small per-op scripts in
examples/perf/ (device choice for their --dry-run, a printed table written to a file).

Everything here imports on a CPU-only machine.
"""

from __future__ import annotations

from pathlib import Path

from fusedlayers.bench.common import (  # noqa: F401  (re-exported for the scripts)
    bench_ms,
    configure_dynamo,
    csv_arg,
    ints_arg,
    rel_err,
    short_error,
)
from fusedlayers.bench.record import (  # noqa: F401  (re-exported for the scripts)
    git_describe,
    matmul_ceiling_tflops,
)


def benchmark_device(dry_run: bool) -> str:
    """ "cuda", or "cpu" for a --dry-run pipeline check; exits when CUDA is wanted but absent."""
    if dry_run:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run for the CPU pipeline check)")
    return "cuda"


def device_label(device: str) -> str:
    """The GPU's name for a table header, or a warning that a dry run measured nothing."""
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "CPU dry run (not a measurement)"


def write_table(table: str, out_dir: Path | None, name: str) -> None:
    """Print a markdown table and, with `out_dir`, write it there as `name`."""
    print(table)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(table)
        print(f"wrote {out_dir / name}")
