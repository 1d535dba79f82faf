"""examples/benchmark_dynamic_shapes.py on the CPU: the loops run end to end (--dry-run, the
flash-attn functions under the Triton interpreter), the run is written as JSON, and the stall
count reads what it says."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import benchmark_dynamic_shapes as bench  # noqa: E402

from fusedlayers.bench.record import read_run  # noqa: E402


def test_stalls_are_calls_after_the_fifth_over_five_medians():
    seconds = [9.0, 3.0, 1.0, 1.0, 1.0] + [0.010] * 20 + [0.051, 0.049, 0.2] + [0.010] * 10
    row = bench.summarize("dense", "fusedlayers", seconds)
    assert row["median_ms"] == 10.0
    assert (row["stalls"], row["stall_calls"]) == (2, [25, 27])  # 0.049 s is not over 5x
    assert row["first_s"] == 9.0 and abs(row["total_s"] - sum(seconds)) < 1e-12


def test_document_lengths_cover_the_tokens_within_bounds():
    for seed in range(20):
        lengths = bench._document_lengths(random.Random(seed), 1000, 16, 300)
        assert sum(lengths) == 1000
        assert all(1 <= n <= 300 for n in lengths) and all(n >= 16 for n in lengths[:-1])


def test_dry_run_writes_every_loop_and_provider(tmp_path):
    out = tmp_path / "dynamic.json"
    assert bench.main(["--dry-run", "--json", str(out)]) == 0
    run = read_run(out)
    assert run["kind"] == "dynamic_shapes" and run["header"]["config"]["calls"] == 4
    got = [(r["loop"], r["provider"]) for r in run["rows"]]
    assert got == [(loop, p) for loop in bench.LOOPS for p in ("fusedlayers", "sdpa")]
    for row in run["rows"]:
        assert row["calls"] == 4 and row["total_s"] > 0 and row["median_ms"] > 0
