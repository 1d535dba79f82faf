"""examples/perf/launch_overhead.py on the CPU (launches stubbed): its backward breakdown wraps
the functions the backward calls by name, so a renamed one must fail here rather than on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "perf"))

import launch_overhead  # noqa: E402

# Stubs every launch (for good: a fresh interpreter), then breaks the backward down on a tiny
# call; prints each row's name, then whether the wrapped functions were put back.
_BREAKDOWN = """
import sys, torch
sys.path.insert(0, "examples/perf")
import fusedlayers
from fusedlayers.kernels import _flash_bwd, attention_ops
from launch_overhead import backward_breakdown, stub_launches
stub_launches(fusedlayers.kernels)
before = (_flash_bwd.launch_planned, attention_ops.flash_attention_backward)
torch.manual_seed(0)
q, k, v = (torch.randn(1, 128, 4, 64, dtype=torch.float16) for _ in range(3))
rows, profile = backward_breakdown(q, k, v, torch.randn_like(q), 2, 3)
for name, us in rows:
    assert us > 0, (name, us)
    print(name.strip())
print("restored", before == (_flash_bwd.launch_planned, attention_ops.flash_attention_backward))
"""


def test_backward_breakdown_times_each_launch():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", _BREAKDOWN], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = done.stdout.splitlines()
    # The tiny call runs the two-pass backward (dQ pass, then dK/dV): each launch is timed in
    # the autograd backward and again in the launcher called directly.
    for launch in ("inside: launch _flash_bwd_dq_kernel", "inside: launch _flash_bwd_dkdv_kernel"):
        assert rows.count(launch) == 2, rows
    assert rows.count("inside: launcher") == 2, rows
    assert "inside: Function.backward" in rows, rows
    assert rows[-1] == "restored True", rows


def test_sm90_backward_parts_name_existing_functions():
    """The sm_90 breakdown's pieces (timed only on an sm_90 GPU) are each a function of its
    module, and the one the backward calls for every launch after the first is among them."""
    parts = launch_overhead.sm90_backward_parts()
    for module, name in parts:
        assert callable(getattr(module, name, None)), (module.__name__, name)
    assert ("_flash_bwd_sm90", "launch_bound") in [
        (module.__name__.rsplit(".", 1)[-1], name) for module, name in parts
    ]
