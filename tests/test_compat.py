"""The Triton version window (`kernels/_compat.py`): outside the releases the GPU suite passed
on, the direct launcher and the Hopper kernels step aside, with a reason, and every call takes
Triton's own launch and the portable kernels."""

import pytest
from fresh_process import fresh_python
from fusedlayers.kernels import _compat, _launch, _sm90_common


@pytest.mark.parametrize("version", [(3, 5), (3, 10), (4, 0)])
def test_outside_the_window_the_fast_paths_are_off(monkeypatch, version):
    monkeypatch.setattr(_compat, "TRITON_VERSION", version)
    monkeypatch.delenv("FUSEDLAYERS_UNTESTED_TRITON", raising=False)
    reason = _compat._fast_paths_off()
    assert reason is not None and "FUSEDLAYERS_UNTESTED_TRITON=1" in reason
    assert "portable kernels" in reason and "3.6" in reason
    monkeypatch.setenv("FUSEDLAYERS_UNTESTED_TRITON", "1")
    assert _compat._fast_paths_off() is None


def test_inside_the_window_the_fast_paths_are_on(monkeypatch):
    monkeypatch.setattr(_compat, "TRITON_VERSION", _compat.TESTED_TRITON[0])
    monkeypatch.delenv("FUSEDLAYERS_UNTESTED_TRITON", raising=False)
    assert _compat._fast_paths_off() is None


def test_the_installed_triton_follows_the_window(monkeypatch):
    """This install's launcher and Gluon path agree with its version: off outside the window,
    and `set_direct_launch(True)` cannot turn the launcher on there."""
    off = _compat.FAST_PATHS_OFF is not None
    assert _compat.FAST_PATHS_OFF == _compat._fast_paths_off()
    previous = _launch.set_direct_launch(True)
    try:
        assert _launch._enabled is not off
    finally:
        _launch.set_direct_launch(previous)
    if off:
        assert not _sm90_common.GLUON_AVAILABLE


def test_the_reason_is_logged_at_import():
    """A fresh process on an untested Triton (here one that says it is 3.5) logs the reason on
    the `fusedlayers` logger."""
    code = (
        "import logging, sys; logging.basicConfig(stream=sys.stdout, level=logging.WARNING)\n"
        "import torch; torch.cuda.is_available = lambda: True  # said only where a GPU is\n"
        "import triton; triton.__version__ = '3.5.0'\n"
        "import fusedlayers.kernels._compat as c\n"
        "print('off' if c.FAST_PATHS_OFF else 'on')"
    )
    out = fresh_python(code, FUSEDLAYERS_UNTESTED_TRITON="0")
    assert "outside the releases the GPU suite passed on" in out, out


def test_import_leaves_the_hopper_kernels_unloaded():
    """`import fusedlayers` loads no Gluon module (about 0.1 s of import time a CPU or an older GPU
    cannot use): the sm_90 kernels load on the first call that reaches an sm_90 GPU. With the
    fast paths allowed, so that the sm_90 modules would be importable."""
    code = (
        "import sys, fusedlayers, fusedlayers.kernels\n"
        "from fusedlayers.kernels import dispatch\n"
        "loaded = sorted(m for m in sys.modules\n"
        "                if m.startswith('triton.experimental.gluon') or m.endswith('_sm90'))\n"
        "print(loaded)\n"
        "dispatch.sm90_kernels('_flash_fwd_sm90')\n"
        "print('fusedlayers.kernels._flash_fwd_sm90' in sys.modules)"
    )
    out = fresh_python(code, FUSEDLAYERS_UNTESTED_TRITON="1")
    assert out.split("\n")[:2] == ["[]", "True"], out
