"""The randomized test's results: one route's summary (`Summary`), the JSON report that
pytest-xdist workers and GPUs merge into (`write_report`, `route_totals`), and the environment
variables its tests read (`env_int`, `env_ints`). tests/random_runner.py runs the cases."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os


@dataclasses.dataclass
class Summary:
    """The results of one route's cases for one seed."""

    route: str
    seed: int
    device: str
    shard: str = ""  # "k/n" when the cases were split over n tests, else ""
    counts: dict = dataclasses.field(default_factory=lambda: dict(passed=0, failed=0, rejected=0))
    failures: list = dataclasses.field(default_factory=list)
    rejections: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    not_run: int = 0  # cases left when the run reached its stop time

    @property
    def cases(self) -> int:
        return sum(self.counts.values())

    def line(self) -> str:
        c = self.counts
        shard = f", shard {self.shard}" if self.shard else ""
        stopped = f", {self.not_run} not run (stop time)" if self.not_run else ""
        return (
            f"random differential [route {self.route}, seed {self.seed}{shard}, {self.device}]: "
            f"{self.cases} cases, {c['passed']} passed, {c['failed']} failed, "
            f"{c['rejected']} rejected{stopped} ({self.seconds:.1f} s)"
        )

    def report(self) -> str:
        lines = [self.line()]
        for f in self.failures:
            lines += [f"FAIL case {f['index']}: {f['case']}"]
            lines += [f"    {p}" for p in f["problems"]]
            lines += [f"    rerun: {f['rerun']}"]
        lines += [f"rejected case {r['index']}: {r['reason']}" for r in self.rejections]
        return "\n".join(lines)


def write_report(path: str, summary: Summary) -> None:
    """Merge `summary` into the JSON file at `path` (locked: pytest-xdist workers share it).
    The file holds {"run": ..., "routes": {route: totals}, "runs": [per (route, seed)]}; a file
    from another pytest run (another PYTEST_XDIST_TESTRUNUID) is replaced.

    The merged report goes to a temporary file that then replaces `path`: a time-boxed run
    interrupts its workers (SIGINT), and one interrupted while rewriting the file in place left
    it truncated mid-entry (seen on a 4-GPU run, 2026-11-28)."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"pid{os.getpid()}")
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as handle:
                text = handle.read()
        except FileNotFoundError:
            text = ""
        data = json.loads(text) if text.strip() else {}
        if data.get("run") != run_id:
            data = dict(run=run_id, runs=[])
        entry = dict(route=summary.route, seed=summary.seed, shard=summary.shard,
                     device=summary.device, cases=summary.cases, **summary.counts,
                     not_run=summary.not_run, seconds=round(summary.seconds, 1),
                     failures=summary.failures, rejections=summary.rejections)  # fmt: skip

        def key(r):
            return r["route"], r["seed"], r.get("shard", "")

        runs = [r for r in data["runs"] if key(r) != key(entry)]
        data["runs"] = sorted([*runs, entry], key=key)
        data["routes"] = route_totals(data["runs"])
        partial = f"{path}.{os.getpid()}.partial"
        with open(partial, "w") as handle:
            json.dump(data, handle, indent=1)
        os.replace(partial, path)


def route_totals(runs: list[dict]) -> dict:
    """{route: {seeds, cases, passed, failed, rejected, not_run}} summed over a report's runs
    (one per route, seed and shard)."""
    totals, seeds = {}, {}
    for r in runs:
        t = totals.setdefault(r["route"], dict(seeds=0, cases=0, passed=0, failed=0, rejected=0,
                                               not_run=0))  # fmt: skip
        seeds.setdefault(r["route"], set()).add(r["seed"])
        t["seeds"] = len(seeds[r["route"]])
        for name in ("cases", "passed", "failed", "rejected", "not_run"):
            t[name] += r.get(name, 0)
    return totals


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


def env_ints(name: str) -> list[int] | None:
    """A comma-separated list of ints from the environment, or None when unset."""
    value = os.environ.get(name, "").strip()
    return [int(x) for x in value.split(",") if x.strip()] if value else None
