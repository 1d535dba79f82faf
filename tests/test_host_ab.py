"""examples/perf/host_ab.py: another revision's package built beside the working tree's, the
interleaved rounds and the agreement check, on the CPU (launches stubbed)."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "perf"))

import host_ab  # noqa: E402


def _in_git_checkout() -> bool:
    found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True)
    return found.returncode == 0


needs_git = pytest.mark.skipif(not _in_git_checkout(), reason="needs the git checkout")


@needs_git
def test_built_package_carries_no_fusedlayers_name(tmp_path):
    commit = host_ab.build_package("HEAD", tmp_path, name="fusedlayers_old")
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    package = tmp_path / "fusedlayers_old"
    sources = list(package.rglob("*.py"))
    # the three source folders, mapped as the distribution maps them
    for path in ("__init__.py", "kernels/_launch.py", "models/__init__.py"):
        assert (package / path).is_file(), path
    word = re.compile(r"\bfusedlayers\b")
    assert sources and not [p for p in sources if word.search(p.read_text())]
    assert "fusedlayers_old::flash_attn_fwd" in (package / "kernels/attention_ops.py").read_text()


def _run(*args: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples/perf/host_ab.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@needs_git
def test_stubbed_rounds_time_both_packages():
    """Both packages import side by side (their custom ops in separate namespaces) and every
    call gets one reading per round."""
    out = _run("--against", "HEAD", "--stubbed", "--rounds", "2", "--calls", "2", "--repeats",
               "1", "--cells", "tiny,decode,layers")  # fmt: skip
    short = subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    rows = [
        line for line in out.splitlines() if line.startswith(("| tiny", "| decode", "| layers"))
    ]
    assert len(rows) == 12, out
    for who in (short, "working tree"):
        assert sum(f": {who}, " in row for row in rows) == 6, out
    for row in rows:
        assert len(row.split("|")[4].split(" / ")) == 2  # two rounds


def test_one_thread_turns_autograd_multithreading_off_for_the_run(monkeypatch):
    """`--one-thread`: every call of the run sees autograd's multithreading off, so backwards
    run on the calling thread; the setting is restored afterwards, and stays on without it."""
    seen = []
    monkeypatch.setattr(
        host_ab, "_main", lambda *args: seen.append(torch.autograd.is_multithreading_enabled())
    )
    host_ab.main("HEAD", ["tiny"], 1, 1, 1, True, one_thread=True)
    assert torch.autograd.is_multithreading_enabled()
    host_ab.main("HEAD", ["tiny"], 1, 1, 1, True)
    assert seen == [False, True]


def test_each_round_starts_one_call_later(monkeypatch):
    order = []
    monkeypatch.setattr(host_ab, "host_us_per_call", lambda fn, calls, repeats: fn() or 1.0)
    calls = {name: (lambda name=name: order.append(name)) for name in "abc"}
    spent = host_ab.rounds_of(calls, rounds=3, calls_per_run=1, repeats=1)
    assert [name for name, _ in itertools.groupby(order)] == list("abcbcacab")
    assert spent == {name: [1.0, 1.0, 1.0] for name in "abc"}


def test_disagreeing_packages_stop_the_run():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    calls = {
        "tiny: old, forward, no grad": lambda: x,
        "tiny: working tree, forward, no grad": lambda: x + 0.5,
    }
    with pytest.raises(AssertionError, match="disagree in output 0"):
        host_ab._check_agreement(calls, ("old", "working tree"))
    calls["tiny: working tree, forward, no grad"] = lambda: x[:100]
    with pytest.raises(AssertionError, match="shapes"):
        host_ab._check_agreement(calls, ("old", "working tree"))
    # a tenth of the elements wrong: 3% off in norm
    wrong = x.clone()
    wrong[::10] *= 0.9
    calls["tiny: working tree, forward, no grad"] = lambda: wrong
    with pytest.raises(AssertionError):
        host_ab._check_agreement(calls, ("old", "working tree"))
    # bf16 values, a tenth of them changed by 1% and rounded again: 0.3% apart in norm, agreed
    rounded = x.bfloat16().float()
    nudged = rounded.clone()
    nudged[::10] = (nudged[::10] * 1.01).bfloat16().float()
    calls["tiny: old, forward, no grad"] = lambda: rounded
    calls["tiny: working tree, forward, no grad"] = lambda: nudged
    host_ab._check_agreement(calls, ("old", "working tree"))
    # large values (a gradient's) with a few near zero moved by 0.05: past 2e-2 elementwise
    # (what the check once compared, and failed correct code on), 0.01% apart in norm, agreed
    large = x * 100
    moved = large.clone()
    moved[large.abs().argsort()[:8]] += 0.05
    calls["tiny: old, forward, no grad"] = lambda: large
    calls["tiny: working tree, forward, no grad"] = lambda: moved
    assert not torch.allclose(large, moved, atol=2e-2, rtol=2e-2)
    host_ab._check_agreement(calls, ("old", "working tree"))


@needs_git
def test_gpt_ab_dry_run_times_both_packages_and_the_plain_model():
    """examples/perf/gpt_ab.py on the CPU: the training and decoding tables, one row per model
    (the decode run has already checked that both packages' tokens are equal)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples/perf/gpt_ab.py"), "--against", "HEAD", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    short = subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    rows = [line.split(" | ")[0] for line in done.stdout.splitlines() if line.startswith("| ")]
    models = [row for row in rows if row != "| model"]
    assert models == [f"| {short}", "| working tree", "| plain"] + [
        f"| {short}",
        "| working tree",
        "| plain, eager",
    ], done.stdout
