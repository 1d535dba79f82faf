"""The decode benchmark's CPU-checkable parts: byte counts, the memory plan, ratios, the table;
and examples/perf/decode_splits.py's arguments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import benchmark_decode as bd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "perf"))

import decode_splits  # noqa: E402


def test_kv_bytes_counts_both_caches():
    assert bd.kv_bytes(8, 1024, 8, 128, 2) == 2 * 8 * 1024 * 8 * 128 * 2


def test_plan_skips_caches_over_the_limit():
    run, skipped = bd.plan([1, 64], [1024, 131072], 8, 128, 2, max_gb=20.0)
    assert run == [(1, 1024), (1, 131072), (64, 1024)]
    assert [(b, s) for b, s, _ in skipped] == [(64, 131072)]
    assert "34.4 GB" in skipped[0][2]


def test_finish_and_markdown():
    row = dict(b=8, s=8192, bytes=10**9, providers={})
    row["providers"] = {
        "ours": {"us": 500.0},
        "ours-paged": {"us": 510.0},
        "sdpa": {"us": 600.0},
        "flex": {"us": 550.0},
        "sdpa-cudnn": {"error": "RuntimeError: no"},
    }
    row = bd.finish(row)
    assert row["providers"]["ours"]["gbps"] == pytest.approx(2000.0)
    assert row["vs_best"] == pytest.approx(550.0 / 500.0)
    assert row["paged_vs_contiguous"] == pytest.approx(1.02)
    table = bd.markdown([row], 3000.0, "## header", ["a note"])
    assert "3000 GB/s" in table and "1.10x" in table and "failed" in table and "- a note" in table
    header = next(line for line in table.splitlines() if line.startswith("| b "))
    assert header.split(" | ")[3:7] == ["ours", "ours-paged", "sdpa", "sdpa-cudnn"]


def test_parse_args_rejects_unknown_providers(capsys):
    assert bd.parse_args([]).providers == list(bd.PROVIDERS)
    with pytest.raises(SystemExit):
        bd.parse_args(["--providers", "ours,nope"])


def test_pipeline_on_the_interpreter(monkeypatch):
    # The GPU path end to end on tiny CPU shapes (fp16: the interpreter's bf16 dot is wrong),
    # with a stand-in for do_bench; SDPA on CPU is the competitor that must work.
    monkeypatch.setattr(bd, "DEVICE", "cpu")
    monkeypatch.setattr(bd, "bench_ms", lambda fn, warmup, rep: (fn(), 0.25)[1])
    args = bd.parse_args(
        ["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--page-size", "16"]
        + ["--dtype", "fp16", "--providers", "ours,ours-paged,sdpa"]
    )
    notes: list[str] = []
    row = bd.run_combo(2, 64, args, notes)
    assert notes == []
    assert set(row["providers"]) == {"ours", "ours-paged", "sdpa"}
    assert all(r["us"] == 250.0 and r["max_error"] < 2e-2 for r in row["providers"].values())
    assert row["vs_best"] == pytest.approx(1.0) and row["paged_vs_contiguous"] == pytest.approx(1.0)


def test_decode_splits_times_both_merges_by_default():
    assert decode_splits.parse_args([]).combine == ["fused", "separate"]
    assert decode_splits.parse_args(["--combine", "separate,fused"]).combine == [
        "separate",
        "fused",
    ]
    assert decode_splits.parse_args(["--combine", "fused"]).combine == ["fused"]
    with pytest.raises(SystemExit):
        decode_splits.parse_args(["--combine", "fused,both"])


def test_decode_splits_times_contiguous_caches_unless_asked():
    assert decode_splits.parse_args([]).layouts == ["contiguous"]
    args = decode_splits.parse_args(["--layouts", "paged,contiguous", "--page-size", "128"])
    assert args.layouts == ["paged", "contiguous"] and args.page_size == 128
    with pytest.raises(SystemExit):
        decode_splits.parse_args(["--layouts", "paged,ring"])


def test_decode_splits_page_prefetch_settings():
    assert decode_splits.parse_args([]).page_prefetch == ["on"]
    assert decode_splits.parse_args(["--page-prefetch", "on,off"]).page_prefetch == ["on", "off"]
    with pytest.raises(SystemExit):
        decode_splits.parse_args(["--page-prefetch", "maybe"])
