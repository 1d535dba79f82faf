"""kernels/dispatch.py: the one environment variable that pins the paths, and the reason logged
for each call the sm_90 kernels could run on this GPU but do not take (an sm_90 GPU faked: the
coverage checks run on the host)."""

from __future__ import annotations

import logging

import pytest
import torch
from fresh_process import fresh_python
from fusedlayers.kernels import dispatch
from fusedlayers.kernels._common import launch_geometry


@pytest.mark.parametrize(
    "value, forward, backward",
    [
        ("", "auto", "auto"),
        ("portable", "portable", "portable"),
        (" sm90 ", "sm90", "sm90"),
        ("forward=sm90,backward=portable", "sm90", "portable"),
        ("backward=portable", "auto", "portable"),
    ],
)
def test_the_variable_sets_both_passes_or_each(value, forward, backward):
    assert dispatch._parse(value) == {"forward": forward, "backward": backward}


@pytest.mark.parametrize(
    "value", ["fast", "forward=fast", "fwd=sm90", "forward=sm90;backward=auto"]
)
def test_a_bad_value_names_the_variable(value):
    with pytest.raises(ValueError, match="FUSEDLAYERS_ATTENTION_PATH"):
        dispatch._parse(value)


def test_the_variable_is_read_at_import():
    code = "from fusedlayers.kernels import forward_path, backward_path\n" \
        "print(forward_path(), backward_path())"  # fmt: skip
    out = fresh_python(code, FUSEDLAYERS_ATTENTION_PATH="forward=portable,backward=sm90")
    assert out.split() == ["portable", "sm90"]


def _forward_plan(q, k, **options):
    call = dict(window_left=-1, window_right=-1, bias=None, alibi_slopes=None, softcap=0.0,
                dropout_p=0.0) | options  # fmt: skip
    return dispatch.sm90_forward_plan(q, k, k, launch_geometry(q, k), **call)


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(softcap=30.0), "softcap"),
        (dict(alibi_slopes=torch.ones(2)), "ALiBi"),
        (dict(window_left=64), "window (64, -1)"),
        (dict(keys=512), "512 keys, fewer than the 1024"),
        (dict(dtype=torch.float32), "dtypes torch.float32"),
        (dict(d=112), "head dims 112, 112"),
    ],
)
def test_each_declined_call_logs_why(change, reason, monkeypatch, caplog):
    if not dispatch.sm90_kernels("_flash_fwd_sm90").GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(dispatch, "_on_sm90", lambda t: True)
    options = dict(change)
    d, keys = options.pop("d", 128), options.pop("keys", 2048)
    dtype = options.pop("dtype", torch.float16)
    base = torch.randn(1, 64, 2, 128, dtype=torch.float16), torch.randn(1, 2048, 2, 128).half()
    q, k = torch.randn(1, 64, 2, d, dtype=dtype), torch.randn(1, keys, 2, d, dtype=dtype)
    with caplog.at_level(logging.DEBUG, logger="fusedlayers.kernels"):
        assert _forward_plan(*base) is not None  # taken, and silently
        assert not caplog.records
        assert _forward_plan(q, k, **options) is None
    (record,) = caplog.records
    assert record.getMessage().startswith("the sm_90 forward does not take this call: ")
    assert reason in record.getMessage()


def test_the_backward_logs_why_too(monkeypatch, caplog):
    if not dispatch.sm90_kernels("_flash_bwd_sm90").GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(dispatch, "_on_sm90", lambda t: True)
    q, k = torch.randn(1, 64, 2, 128).half(), torch.randn(1, 2048, 2, 128).half()
    lse = torch.zeros(1, 2, 64)
    call = dict(window_left=-1, window_right=-1, bias=None, alibi_slopes=None, softcap=0.0,
                dropout_p=0.0, deterministic=True)  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="fusedlayers.kernels"):
        assert dispatch.sm90_backward_plan(q, k, k, q, lse, launch_geometry(q, k), **call) is None
    (record,) = caplog.records
    assert "backward does not take this call: deterministic=True" in record.getMessage()


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_set_path_names_bad_values(which):
    setter = getattr(dispatch, f"set_{which}_path")
    with pytest.raises(ValueError, match=f"{which} path must be one of .* got 'fast'"):
        setter("fast")
    assert getattr(dispatch, f"{which}_path")() == "auto"


def test_head_dims_between_tile_widths_take_the_next_width():
    """80 and 96 run on 128-wide tiles, 160 and 192 on 256-wide ones, (192, 128) with a
    128-wide v; their scores take two products, whose second width must be a power of two of
    at least 16 (the wgmma's k): every covered dim is one."""
    sm90 = dispatch.sm90_kernels("_flash_fwd_sm90")
    assert sm90.widths(96, 96) == (128, 128) and sm90.widths(192, 128) == (256, 128)
    for d_qk, d_v in sm90.SUPPORTED_DIMS:
        for d, width in zip((d_qk, d_v), sm90.widths(d_qk, d_v)):
            assert width // 2 < d <= width and width in sm90.TILES
            rest = d - width // 2
            assert d == width or (rest >= 16 and rest & (rest - 1) == 0), (d, width)


def test_rows_narrower_than_the_tile_take_the_portable_kernels():
    """One head of d = 96 in rows 96 wide: a 128-wide TMA box would be wider than the grid."""
    sm90 = dispatch.sm90_kernels("_flash_fwd_sm90")
    one = torch.randn(1, 256, 1, 96, dtype=torch.float16)
    two = torch.randn(1, 256, 2, 96, dtype=torch.float16)
    assert sm90.plan_views(one, one, one, varlen=False) is None
    assert sm90.plan_views(two, two, two, varlen=False) is not None
