"""The randomized test's own bookkeeping: shards split a route's cases without overlap, a stop
time leaves the remaining cases counted as not run, and the JSON report sums shards per route.
The cases themselves are replaced by a stub outcome here (their checks run in
test_random_differential.py)."""

from __future__ import annotations

import json
import time

import pytest
import random_report
import random_runner


def _fake_cases(monkeypatch, ran):
    def run_case(case, device):
        ran.append(case)
        return ("fail", ["planted"]) if len(ran) == 3 else ("pass", [])

    monkeypatch.setattr(random_runner, "run_case", run_case)


def test_shards_cover_every_case_once(monkeypatch):
    ran = []
    _fake_cases(monkeypatch, ran)
    summaries = [random_runner.run_route("portable", 5, 23, "cpu", shard=(k, 4), log=str)
                 for k in range(4)]  # fmt: skip
    assert sorted(s.cases for s in summaries) == [5, 6, 6, 6]
    assert sum(s.cases for s in summaries) == 23 == len(ran)
    assert len({str(case) for case in ran}) == 23  # every index drawn once: no shard repeats one
    assert [s.shard for s in summaries] == ["0/4", "1/4", "2/4", "3/4"]
    assert sum(s.counts["failed"] for s in summaries) == 1


def test_stop_time_counts_the_cases_not_run(monkeypatch):
    ran = []
    _fake_cases(monkeypatch, ran)
    summary = random_runner.run_route("decode", 0, 9, "cpu", stop_at=time.time() - 1, log=str)
    assert (summary.cases, summary.not_run, ran) == (0, 9, [])
    assert "9 not run" in summary.line()


def test_report_sums_shards_and_counts_seeds(monkeypatch, tmp_path):
    ran = []
    _fake_cases(monkeypatch, ran)
    path = tmp_path / "report.json"
    for seed in (0, 1):
        for k in range(3):
            summary = random_runner.run_route("sm90", seed, 10, "cpu", shard=(k, 3), log=str)
            random_report.write_report(str(path), summary)
    # Writing one shard again replaces its entry instead of adding to the totals.
    random_report.write_report(str(path), summary)
    data = json.loads(path.read_text())
    assert len(data["runs"]) == 6
    totals = data["routes"]["sm90"]
    assert (totals["seeds"], totals["cases"], totals["failed"], totals["not_run"]) == (2, 20, 1, 0)


def test_report_survives_a_write_interrupted_midway(monkeypatch, tmp_path):
    """A time-boxed run interrupts its workers; one stopped while writing must leave the report
    as it was, not truncated mid-entry (a 4-GPU run's report no longer parsed)."""
    ran = []
    _fake_cases(monkeypatch, ran)
    path = tmp_path / "report.json"
    first = random_runner.run_route("portable", 0, 4, "cpu", shard=(0, 2), log=str)
    random_report.write_report(str(path), first)
    before = path.read_text()

    def interrupted_dump(data, handle, **kwargs):
        handle.write(json.dumps(data)[:40])  # part of the report, then the signal
        raise KeyboardInterrupt

    second = random_runner.run_route("portable", 0, 4, "cpu", shard=(1, 2), log=str)
    monkeypatch.setattr(random_report.json, "dump", interrupted_dump)
    with pytest.raises(KeyboardInterrupt):
        random_report.write_report(str(path), second)
    monkeypatch.undo()
    assert path.read_text() == before
    assert json.loads(before)["routes"]["portable"]["cases"] == first.cases
