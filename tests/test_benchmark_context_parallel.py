"""examples/perf/benchmark_context_parallel.py --dry-run under torchrun on CPU: the script runs
end to end and prints its table (the GPU numbers need two GPUs)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "examples/perf/benchmark_context_parallel.py"


def test_dry_run_prints_the_table():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run = subprocess.run(
        [*cmd, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, f"torchrun exit {run.returncode}:\n{run.stderr[-4000:]}"
    assert "| pass | cp2 ms | cp2 TFLOP/s per GPU |" in run.stdout
    assert "| fwd+bwd |" in run.stdout
