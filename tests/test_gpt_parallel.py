"""examples/train_gpt.py with context parallelism and FSDP2 on CPU (torchrun, gloo), at a toy
size, against one process on the same global batches.

Every run draws the same global batches, so each logged loss must agree with the single process
to rounding (observed: <= 1e-6; 1e-4 allows reduction order and nothing else: a wrong position,
token split, loss average or gradient route moves the loss by 1e-2 or more within 4 steps).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
ARGS = (
    "--config tiny --context-length 32 --batch-size 4 --steps 4 --eval-interval 2 "
    "--eval-batches 1 --ckpt-interval 100 --warmup 2 --sample-tokens 4 --threads 1"
).split()


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def one_process(train_gpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one")
    train_gpt.main([*ARGS, "--out-dir", str(out)])
    return out


def _torchrun(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run = subprocess.run(
        [*cmd, "--nproc_per_node", str(nproc), str(SCRIPT), *ARGS, *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    # The launcher's own output says why a run failed (rendezvous, a rank's traceback).
    assert run.returncode == 0, f"torchrun exit {run.returncode}:\n{run.stderr[-4000:]}"


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _assert_same_curve(run: Path, one: Path) -> None:
    a, b = _history(run), _history(one)
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):
        key = "train_loss" if "train_loss" in x else "val_loss"
        assert abs(x[key] - y[key]) < 1e-4, (x, y)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_context_parallel_matches_one_process(one_process, tmp_path):
    """--context-parallel 2 on 2 ranks (DDP), and 2 x 2 data parallel on 4 ranks with FSDP2:
    each rank trains its chunks of each sequence, with RoPE at the full-sequence positions."""
    _torchrun(2, "--context-parallel", "2", "--out-dir", str(tmp_path / "cp"))
    _assert_same_curve(tmp_path / "cp", one_process)
    _torchrun(4, "--context-parallel", "2", "--fsdp", "--out-dir", str(tmp_path / "cp-dp"))
    _assert_same_curve(tmp_path / "cp-dp", one_process)


def test_fsdp_matches_one_process_and_resumes(train_gpt, one_process, tmp_path):
    """FSDP2 on 2 ranks, stopped at step 2 and resumed sharded from the gathered checkpoint,
    follows the single process; its checkpoint holds the full weights, and an unsharded run
    resumes from it too (one checkpoint format for every kind of run)."""
    out = tmp_path / "fsdp"
    _torchrun(2, "--fsdp", "--stop-at", "2", "--out-dir", str(out))
    (tmp_path / "plain").mkdir()
    for name in ("last.safetensors", "last.train.safetensors"):
        (tmp_path / "plain" / name).write_bytes((out / name).read_bytes())
    _torchrun(2, "--fsdp", "--resume", "--out-dir", str(out))
    _assert_same_curve(out, one_process)
    sharded, single = _weights(out / "last.safetensors"), _weights(one_process / "last.safetensors")
    assert sharded.keys() == single.keys()
    # Adam turns rounding-level gradient differences on near-zero entries into steps of up to
    # ~lr, so entries drift apart by up to ~3e-5 in 4 steps (mean 1e-8); a shard saved stale or
    # from the wrong rank would be off by the weights' scale, ~2e-2.
    for key in single:
        torch.testing.assert_close(sharded[key], single[key], rtol=0, atol=1e-4, msg=key)
    train_gpt.main([*ARGS, "--out-dir", str(tmp_path / "plain"), "--resume"])
    _assert_same_curve(tmp_path / "plain", one_process)


def test_parallel_options_are_checked(train_gpt, tmp_path):
    with pytest.raises(SystemExit, match="--context-parallel 2 must divide the world size 1"):
        train_gpt.main([*ARGS, "--out-dir", str(tmp_path), "--context-parallel", "2"])
    with pytest.raises(SystemExit, match="--fsdp needs several processes"):
        train_gpt.main([*ARGS, "--out-dir", str(tmp_path), "--fsdp"])
