"""examples/benchmark_transformers.py end to end on the CPU (--tiny, fp32): both attention
implementations train from the same weights on the same batches, and the run's JSON is complete.
On the CPU "fusedlayers" takes the reference path, so the losses agree to fp32 rounding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import benchmark_transformers as bt  # noqa: E402

from fusedlayers.bench.record import read_run  # noqa: E402


def test_tiny_padded_run_writes_both_implementations(tmp_path):
    out = tmp_path / "hf.json"
    run = bt.main(["--tiny", "--padding", "--repeat-sdpa", "--json", str(out)])
    assert read_run(out)["kind"] == "transformers" == run["kind"]
    header = run["header"]
    assert {"date", "gpu", "torch", "transformers", "commit", "command"} <= set(header)
    assert header["config"]["dtype"] == "fp32" and header["config"]["padding"]
    rows = {r["run"]: r for r in run["rows"]}
    assert list(rows) == ["sdpa", "fusedlayers", "sdpa-repeat"]
    steps = bt.TINY["warmup"] + bt.TINY["steps"]
    for r in rows.values():
        assert len(r["losses"]) == steps and len(r["step_ms"]) == bt.TINY["steps"]
        assert r["ms_per_step_median"] > 0 and r["tokens_per_s"] > 0
    # Same weights, same batches, fp32: the runs differ by rounding only, and training moved
    # the loss (the optimizer stepped on the model each run started from).
    torch.testing.assert_close(rows["fusedlayers"]["losses"], rows["sdpa"]["losses"])
    assert rows["sdpa-repeat"]["losses"] == rows["sdpa"]["losses"]
    assert rows["sdpa"]["losses"][0] != rows["sdpa"]["losses"][-1]
    assert header["summary"]["max_rel_loss_diff_vs_sdpa"] < 1e-5


def test_padded_batches_mask_the_loss_and_flags_override_tiny():
    args = bt.parse_args(["--tiny", "--padding", "--seq-len", "16", "--steps", "4"])
    assert (args.seq_len, args.steps, args.layers, args.dtype) == (16, 4, 2, "fp32")
    batches = bt.make_batches(args, "cpu")
    assert len(batches) == args.warmup + args.steps
    again = bt.make_batches(args, "cpu")  # the seed fixes the batches every run sees
    for b, b2 in zip(batches, again):
        assert all(torch.equal(b[k], b2[k]) for k in b)
        pad = b["attention_mask"] == 0
        assert (b["labels"][pad] == -100).all() and (b["labels"][~pad] >= 0).all()
        # right padding: every row is real tokens, then padding
        assert torch.equal(b["attention_mask"].sort(1, descending=True).values, b["attention_mask"])


def test_tiny_generate_run_writes_both_implementations(tmp_path):
    """examples/benchmark_transformers_generate.py --tiny: both implementations generate every
    new token of every row from the same prompts, with the same tokens (the CPU reference path
    in fp32), and the run's JSON and its report table are complete."""
    import benchmark_transformers_generate as bg

    from fusedlayers.bench import tables

    out = tmp_path / "gen.json"
    run = bg.main(["--tiny", "--json", str(out)])
    assert read_run(out)["kind"] == "transformers_generate" == run["kind"]
    assert {"date", "gpu", "torch", "transformers", "commit", "command"} <= set(run["header"])
    rows = run["rows"]
    assert [(r["batch_size"], r["attn_implementation"]) for r in rows] == [
        (1, "sdpa"), (1, "fusedlayers"), (2, "sdpa"), (2, "fusedlayers"),
    ]  # fmt: skip
    for r in rows:
        assert r["seconds_median"] > 0 and r["first_s"] > 0
        expected = r["batch_size"] * bg.TINY["new_tokens"] / r["seconds_median"]
        assert r["new_tokens_per_s"] == pytest.approx(expected)
        assert r["same_tokens_as_sdpa"] == 1.0 and r["cache"] == "StaticCache"
    assert rows[0]["speedup_vs_sdpa"] == 1.0
    table = "\n".join(tables.transformers_generate_table(rows))
    assert "| 2 | fusedlayers |" in table
