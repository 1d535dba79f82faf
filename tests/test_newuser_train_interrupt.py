"""Ctrl-C during examples/train_gpt.py: one line saying where the run was saved and how to go on,
exit status 130, and a checkpoint that `--resume` continues exactly (CPU, toy size)."""

import importlib.util
import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
ARGS = (
    "--config tiny --context-length 32 --batch-size 4 --steps 6 --eval-interval 3 "
    "--eval-batches 1 --ckpt-interval 100 --warmup 2 --sample-tokens 4 --threads 1"
).split()


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt_interrupt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def seed():
    return str(int(torch.randint(0, 10**6, ())))


@pytest.fixture(scope="module")
def straight(train_gpt, seed, tmp_path_factory):
    """The same run, never interrupted."""
    out = tmp_path_factory.mktemp("straight")
    train_gpt.main([*ARGS, "--seed", seed, "--out-dir", str(out)])
    return out


def _interrupt_at(train_gpt, monkeypatch, step: int, action) -> None:
    """Call `action()` once, when the loop sets the learning rate of `step` (its start)."""
    real, done = train_gpt.lr_at, []

    def lr_at(s, args):
        if s == step and not done:
            done.append(s)
            action()
        return real(s, args)

    monkeypatch.setattr(train_gpt, "lr_at", lr_at)


def _main_exits(train_gpt, argv, capsys) -> tuple[int, str]:
    """(exit status, stdout) of a run that must stop on its own after the interrupt."""
    try:
        train_gpt.main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped train_gpt.main (a traceback for the user)")
    except SystemExit as e:
        return e.code, capsys.readouterr().out
    pytest.fail("train_gpt.main returned normally after the interrupt")


def _saved_step(out: Path) -> int:
    with safe_open(str(out / "last.train.safetensors"), framework="pt") as f:
        return json.loads(f.metadata()["step"])


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _contents(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _resume_matches(train_gpt, seed, out, straight, capsys) -> None:
    train_gpt.main([*ARGS, "--seed", seed, "--out-dir", str(out), "--resume"])
    assert "resumed from" in capsys.readouterr().out
    assert _history(out) == _history(straight)
    for name in ("last.safetensors", "last.train.safetensors"):
        (a, meta_a), (b, meta_b) = _contents(out / name), _contents(straight / name)
        assert meta_a == meta_b and a.keys() == b.keys(), name
        assert all(torch.equal(a[k], b[k]) for k in a), name


def _raise():
    raise KeyboardInterrupt


def test_interrupt_saves_the_step_reached_and_resume_continues_exactly(
    train_gpt, seed, straight, tmp_path, monkeypatch, capsys
):
    _interrupt_at(train_gpt, monkeypatch, 4, _raise)
    code, out = _main_exits(train_gpt, [*ARGS, "--seed", seed, "--out-dir", str(tmp_path)], capsys)
    assert code == 130
    path = tmp_path / "last.safetensors"
    assert f"interrupted: saved step 4 to {path}" in out and "--resume" in out, out
    assert _saved_step(tmp_path) == 4
    monkeypatch.undo()
    _resume_matches(train_gpt, seed, tmp_path, straight, capsys)


def test_ctrl_c_finishes_the_step_in_progress_first(
    train_gpt, seed, straight, tmp_path, monkeypatch, capsys
):
    """A real SIGINT in the middle of step 4: the step completes (no half-applied optimizer
    update), then step 5 is saved."""
    # Python's own handler during the run, as in a terminal (a suite started in the background
    # by a shell has SIGINT ignored); the run must put it back.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_at(train_gpt, monkeypatch, 4, lambda: signal.raise_signal(signal.SIGINT))
        argv = [*ARGS, "--seed", seed, "--out-dir", str(tmp_path)]
        code, out = _main_exits(train_gpt, argv, capsys)
        assert code == 130 and "interrupted: saved step 5" in out, out
        assert _saved_step(tmp_path) == 5
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    _resume_matches(train_gpt, seed, tmp_path, straight, capsys)


def test_second_ctrl_c_stops_at_once_without_saving(train_gpt, seed, tmp_path, monkeypatch, capsys):
    def twice():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)

    _interrupt_at(train_gpt, monkeypatch, 4, twice)
    code, out = _main_exits(train_gpt, [*ARGS, "--seed", seed, "--out-dir", str(tmp_path)], capsys)
    assert code == 130
    assert "interrupted at step 4: stopped in the middle of the step, without saving" in out, out
    assert "no checkpoint" in out
    assert not (tmp_path / "last.safetensors").exists()


def test_distributed_interrupt_does_not_save(train_gpt, tmp_path, monkeypatch, capsys):
    """Under torch.distributed the ranks stop at different points: no save, and the message
    says so (the loop is driven directly as rank 0 of 2, no process group needed)."""
    args = train_gpt.parse_args([*ARGS, "--eval-batches", "0", "--out-dir", str(tmp_path)])
    train_gpt.apply_device_defaults(args)
    args.torch_device = torch.device("cpu")
    model, _ = train_gpt.build(args, args.torch_device)
    optimizer = train_gpt.make_optimizer(model, args)

    def step_raising(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_gpt, "train_step", step_raising)
    loop = dict(model=model, core=model, optimizer=optimizer, data=(None, None), args=args)
    try:
        train_gpt.run(**loop, step=0, history=[], rank=0, world=2)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped train_gpt.run")
    except SystemExit as e:
        assert e.code == 130
    else:
        pytest.fail("run returned normally after the interrupt")
    out = capsys.readouterr().out
    assert "interrupted at step 0: not saved" in out and "torch.distributed" in out, out
    assert not (tmp_path / "last.safetensors").exists()
