"""examples/perf/benchmark_context_parallel.py --dry-run under torchrun on CPU: the script runs
end to end, prints its table and writes its run as JSON (the GPU numbers need two GPUs)."""

import subprocess
import sys
from pathlib import Path

import pytest

from fusedlayers.bench.record import read_run

SCRIPT = Path(__file__).resolve().parent.parent / "examples/perf/benchmark_context_parallel.py"


def test_dry_run_prints_the_table_and_writes_the_run(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out = tmp_path / "cp.json"
    run = subprocess.run(
        [*cmd, str(SCRIPT), "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, f"torchrun exit {run.returncode}:\n{run.stderr[-4000:]}"
    assert "| pass | cp2 ms | cp2 TFLOP/s per GPU |" in run.stdout
    assert "| fwd+bwd |" in run.stdout
    written = read_run(out)  # rank 0's run, as the report reads it
    assert written["kind"] == "context_parallel" and written["header"]["config"]["world"] == 2
    assert [r["pass"] for r in written["rows"]] == ["fwd", "fwd+bwd"]
    for row in written["rows"]:
        assert row["cp_tflops_per_gpu"] == pytest.approx(row["flops_per_gpu"] / row["cp_ms"] / 1e9)
