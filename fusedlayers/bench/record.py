"""A benchmark run as data: the header that says where and how it ran, and the JSON file.

Every benchmark script writes `{"kind": ..., "header": {...}, "rows": [...]}` through
`write_run`; `fusedlayers.bench.report` renders BENCHMARKS.md from those files. The header holds
the provenance a reader needs to trust or repeat a number:

    date            UTC, "YYYY-MM-DD HH:MM UTC"
    gpu, driver     the device's name and the NVIDIA driver (left out where not found)
    torch, triton, cudnn, python       versions in this process
    fusedlayers, commit                the package version and the git commit it ran from
                                       ("-dirty": tracked files differed from that commit)
    command         the exact command line
    matmul_tflops   the same-process bf16 8192^3 matmul rate, where the benchmark measures it:
                    a GPU that is throttled or shared reads low here first

Everything here imports on a CPU-only machine; CUDA is touched only when asked for.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

KINDS = (
    "attention", "decode", "generate", "gpt", "context_parallel", "dynamic_shapes", "transformers",
    "transformers_generate",
)  # fmt: skip
_HERE = Path(__file__).resolve()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=_HERE.parent, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_describe() -> str:
    """The short commit of the checkout this package runs from, "-dirty" when tracked files
    differ from it; "unknown" outside a git checkout of this source tree (an installed wheel,
    or a site-packages that happens to sit inside some other repository)."""
    top = _git("rev-parse", "--show-toplevel")
    if not top or _HERE != (Path(top) / "fusedlayers" / "bench" / "record.py").resolve():
        return "unknown"
    commit = _git("rev-parse", "--short=7", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return commit + ("-dirty" if dirty else "")


def gpu_driver() -> str | None:
    """The NVIDIA driver version, from the kernel module or nvidia-smi; None where neither
    answers (no NVIDIA GPU, a container without either)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        for word in text.split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return word
    except OSError:
        pass
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def matmul_ceiling_tflops(warmup: int = 25, rep: int = 100) -> float:
    """bf16 8192^3 matmul rate in this process: the practical ceiling anchors.md quotes, and the
    gate that tells a healthy GPU from a throttled or shared one before its numbers are read."""
    import torch

    from .common import bench_ms

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, warmup, rep)
    return 2 * n**3 / ms / 1e9


def run_header(gate: bool = False, warmup: int = 25, rep: int = 100, **extra) -> dict:
    """The provenance of a run in this process (see the module docstring). `gate` measures the
    matmul rate (CUDA only); `extra` adds the benchmark's own fields (its config, its method)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # no Triton on this platform: the kernels cannot have run
        triton_version = None
    try:  # a broken fusedlayers import still lets the competitors be measured
        import fusedlayers

        version = fusedlayers.__version__
    except Exception as error:
        version = f"import failed: {type(error).__name__}: {error}"[:200]
    cuda = torch.cuda.is_available()
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name() if cuda else "CPU (no CUDA: not a GPU measurement)",
        "driver": gpu_driver() if cuda else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "python": sys.version.split()[0],
        "fusedlayers": version,
        "commit": git_describe(),
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
    }
    if gate and cuda:
        header["matmul_tflops"] = round(matmul_ceiling_tflops(warmup, rep), 1)
    header |= extra
    return {key: value for key, value in header.items() if value is not None}


def write_run(path: str | os.PathLike, kind: str, header: dict, rows: list) -> dict:
    """Write one run as JSON (sorted keys, so the same run gives the same bytes); returns it.

    The file is replaced atomically: a benchmark that rewrites it after every case and is
    killed mid-write leaves the previous complete version, never half a file.
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {KINDS}")
    run = {"kind": kind, "header": header, "rows": rows}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return run


def read_run(path: str | os.PathLike) -> dict:
    """One run written by `write_run`; ValueError naming the file if it is not one."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not {"kind", "header", "rows"} <= set(data):
        raise ValueError(f"{path}: not a benchmark run (expected kind, header and rows)")
    if data["kind"] not in KINDS:
        raise ValueError(f"{path}: kind {data['kind']!r} is not one of {KINDS}")
    return data
