"""The debug tools on a machine without CUDA: they say that no kernel ran instead of printing a
table of zeros under the label "kernel", and `debug_gpt.py` checks `--break-layer` up front."""

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fusedlayers import DotProductAttention, reference_mode
from fusedlayers.debug import compare_with_reference
from fusedlayers.reference_switch import ReferenceSwitch

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "debug_gpt.py"


class Block(ReferenceSwitch):
    """x [b, s, d] -> x + attention(q, q, q) [b, s, d], q = proj(x)."""

    def __init__(self, d: int = 16, h: int = 2) -> None:
        super().__init__()
        self.h = h
        self.proj = torch.nn.Linear(d, d)
        self.attn = DotProductAttention(h, d // h, qkv_format="bshd", attn_mask_type="causal")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.proj(x).view(b, s, self.h, d // self.h)
        return x + self.attn(q, q, q).reshape(b, s, d)


def _compare(model, x):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = compare_with_reference(model, x)
    return report, [str(w.message) for w in caught]


def test_cpu_comparison_says_no_kernel_ran(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    report, caught = _compare(Block().double(), torch.randn(2, 5, 16, dtype=torch.float64))
    assert all(r.output.max_abs == 0 for r in report.records)  # reference against itself
    assert report.reference_only is not None and "cpu" in report.reference_only
    assert any("no kernel ran" in m and "cpu" in m for m in caught), caught
    assert str(report).splitlines()[0].startswith("NO KERNEL RAN: ")
    text = " ".join(str(report).split())  # the note is wrapped at 100 columns
    assert "both passes ran the PyTorch reference path" in text
    assert "comparison is empty" in text
    assert "export TRITON_INTERPRET=1 before Python starts" in text
    assert "loss: 'kernel' pass (reference path)" in text


def test_cpu_comparison_points_at_the_interpreter_when_it_is_on(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    report, _ = _compare(Block().double(), torch.randn(2, 5, 16, dtype=torch.float64))
    assert "TRITON_INTERPRET=1 is set" in report.reference_only
    assert "flash_attn_func" in report.reference_only


def test_reference_mode_around_the_comparison_is_named():
    with reference_mode():
        report, caught = _compare(Block().double(), torch.randn(2, 5, 16, dtype=torch.float64))
    assert "reference_mode()" in report.reference_only
    assert "call it outside that block" in report.reference_only
    assert any("reference_mode()" in m for m in caught), caught


@pytest.mark.gpu
def test_cuda_comparison_runs_the_kernels():
    model = Block().cuda()
    report, caught = _compare(model, torch.randn(2, 5, 16, device="cuda"))
    assert report.reference_only is None and not caught, caught
    assert "NO KERNEL RAN" not in str(report) and "loss: kernel " in str(report)


@pytest.fixture
def debug_gpt():
    spec = importlib.util.spec_from_file_location("debug_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = ["--batch-size", "1", "--seq-len", "16"]


@pytest.mark.parametrize("layer", ["5", "4", "-1"])
def test_break_layer_out_of_range_is_an_argument_error(debug_gpt, monkeypatch, capsys, layer):
    monkeypatch.setattr(sys, "argv", ["debug_gpt.py", *SMALL, "--break-layer", layer])
    with pytest.raises(SystemExit) as exit_info:
        debug_gpt.main()
    assert exit_info.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert f"--break-layer {layer}" in err and "0..3" in err and "'tiny'" in err, err


def test_debug_gpt_on_cpu_says_no_kernel_ran(debug_gpt, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["debug_gpt.py", *SMALL, "--break-layer", "3"])
    debug_gpt.main()
    out = capsys.readouterr().out
    # Both reports (healthy, then planted fault) say it; the planted fault is still found.
    assert out.count("NO KERNEL RAN: ") == 2, out
    assert "pinpointed: layers.3.self_attention.core_attention" in out
