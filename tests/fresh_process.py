"""Run Python code in a fresh interpreter: what import time does (environment variables read at
import, modules loaded by `import fusedlayers`) shows only in a process of its own."""

from __future__ import annotations

import subprocess
import sys


def fresh_python(code: str, **env: str) -> str:
    """stdout of `python -c code` in a new process with only PATH="" and `env` set; fails the
    test, with its stderr, when the process fails."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={"PATH": "", **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout
