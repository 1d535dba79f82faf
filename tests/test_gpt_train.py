"""examples/train_gpt.py end to end on CPU at a toy size: outputs, and exact resume."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fusedlayers.models import read_config
from safetensors import safe_open

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
ARGS = (
    "--config tiny --context-length 32 --batch-size 4 --steps 6 --eval-interval 3 "
    "--eval-batches 1 --ckpt-interval 100 --warmup 2 --sample-tokens 16 --threads 1"
).split()


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_train_then_resume_matches_one_run(train_gpt, tmp_path, capsys):
    seed = str(int(torch.randint(0, 10**6, ())))
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_gpt.main([*ARGS, "--seed", seed, "--out-dir", str(straight)])
    out = capsys.readouterr().out
    assert "step 0: val loss" in out and "sample:\nROMEO:" in out
    assert (straight / "loss.png").stat().st_size > 1000
    assert read_config(straight / "last.safetensors").context_length == 32

    train_gpt.main([*ARGS, "--seed", seed, "--out-dir", str(split), "--stop-at", "3"])
    assert not (split / "log.jsonl").exists()  # stopped early: checkpoint only
    train_gpt.main([*ARGS, "--seed", seed, "--out-dir", str(split), "--resume"])
    assert "resumed from" in capsys.readouterr().out
    # Same data stream, optimizer state and RNG: the two runs agree to the last bit.
    assert _history(split) == _history(straight)
    for name in ("last.safetensors", "last.train.safetensors"):
        (a, meta_a), (b, meta_b) = _contents(split / name), _contents(straight / name)
        assert meta_a == meta_b and a.keys() == b.keys(), name
        assert all(torch.equal(a[k], b[k]) for k in a), name


def _contents(path: Path) -> tuple[dict, dict]:
    """Tensors and metadata (the file bytes differ: safetensors writes metadata in hash order)."""
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_fp8_training_resumes_exactly_from_its_fp8_metadata(train_gpt, tmp_path):
    """--fp8 delayed (emulated on the CPU): the checkpoint carries every GEMM module's scales and
    amax histories as `_extra_state`, so a resumed run casts as the uninterrupted one did."""
    args = [*ARGS, "--fp8", "delayed", "--use-reference", "--sample-tokens", "4"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_gpt.main([*args, "--out-dir", str(straight)])
    train_gpt.main([*args, "--out-dir", str(split), "--stop-at", "3"])
    weights, _ = _contents(split / "last.safetensors")
    extra = [k for k in weights if k.endswith("_extra_state")]
    assert extra and all(weights[k].numel() > 0 for k in extra)
    train_gpt.main([*args, "--out-dir", str(split), "--resume"])
    assert _history(split) == _history(straight)


def test_fp8_without_an_fp8_gpu_is_a_clear_error(train_gpt, tmp_path):
    with pytest.raises(SystemExit, match="--fp8 needs a CUDA GPU.*--use-reference"):
        train_gpt.main([*ARGS, "--device", "cpu", "--fp8", "current", "--out-dir", str(tmp_path)])


def test_resume_without_checkpoint_is_a_clear_error(train_gpt, tmp_path):
    with pytest.raises(SystemExit, match="--resume: .*no such checkpoint file"):
        train_gpt.main([*ARGS, "--out-dir", str(tmp_path), "--resume"])


def test_ddp_two_processes_match_one(train_gpt, tmp_path):
    """torchrun with 2 CPU processes (gloo) follows the 1-process loss curve at the same global
    batch: each rank computes half of the same batch and DDP averages the gradients."""
    args = [*ARGS, "--steps", "4", "--eval-interval", "2", "--sample-tokens", "4"]
    train_gpt.main([*args, "--out-dir", str(tmp_path / "one")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run = subprocess.run(
        [
            *cmd,
            str(SCRIPT),
            *args,
            "--out-dir",
            str(tmp_path / "two"),
            "--compare-to",
            str(tmp_path / "one"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    # The launcher's own output says why a run failed (rendezvous, a rank's traceback).
    assert run.returncode == 0, f"torchrun exit {run.returncode}:\n{run.stderr[-4000:]}"
    assert f"vs {tmp_path / 'one'}: train_loss max |diff|" in run.stdout
    one, two = _history(tmp_path / "one"), _history(tmp_path / "two")
    assert [h["step"] for h in one] == [h["step"] for h in two]
    for a, b in zip(one, two):
        key = "train_loss" if "train_loss" in a else "val_loss"
        assert abs(a[key] - b[key]) < 1e-4, (a, b)


def test_context_longer_than_the_held_out_split_is_a_clear_error(train_gpt, tmp_path):
    """The held-out tail is ~5% of the corpus: a context longer than it fails up front, naming
    the flag, unless validation is off; with --eval-batches 0 the run logs no validation."""
    n_val = len(train_gpt.load_corpus()[1])
    long = ["--context-length", str(n_val), "--steps", "1", "--out-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match=f"--context-length {n_val} does not fit the held-out"):
        train_gpt.main([*ARGS, *long])
    args = [*ARGS, "--context-length", "32", "--eval-batches", "0", "--out-dir", str(tmp_path)]
    train_gpt.main(args)
    history = _history(tmp_path)
    assert len(history) == 6 and all("val_loss" not in h for h in history)
