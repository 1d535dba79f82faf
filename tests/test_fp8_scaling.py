"""FP8 numerics against independent reimplementations: the delayed-scaling window for every
amax_compute_algo and margin over several steps, current scaling's rule, saturating casts, block
scales, and exact transposes."""

from __future__ import annotations

import math

import pytest
import torch

from fusedlayers import recipe
from fusedlayers.fp8 import scaling
from fusedlayers.fp8.scaling import (
    delayed_update,
    dequantize,
    fp8_dtype,
    quantize,
    quantize_blocks,
    scale_from_amax,
    transpose,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def expected_scales(amaxes, length, algo, margin, fp8_max, start=1.0):
    """TE's delayed scaling told as a window over the last `length` recorded amaxes."""
    window, scale, scales = [], start, []
    for a in amaxes:
        window = (window + [a])[-length:]
        chosen = max(window) if algo == "max" else a
        if chosen > 0 and math.isfinite(chosen):
            scale = fp8_max / chosen / 2**margin
        scales.append(scale)
    return scales


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("length", [1, 3, 8])
def test_delayed_update_follows_the_window(algo, margin, length):
    gen = torch.Generator().manual_seed(length + 10 * margin)
    columns = 3
    amaxes = (torch.rand(12, columns, generator=gen, dtype=torch.float64) * 50).float()
    amaxes[5, 1] = 0.0  # a step that saw nothing keeps the previous scale
    r = recipe.DelayedScaling(margin=margin, amax_history_len=length, amax_compute_algo=algo)
    history = torch.zeros(length, columns)
    scale = torch.ones(columns)
    got = []
    for step in range(amaxes.shape[0]):
        history[0] = amaxes[step]  # what the casts record during the step
        delayed_update(history, scale, 448.0, r)
        assert torch.all(history[0] == 0), "slot 0 is cleared for the next step"
        got.append(scale.clone())
    for c in range(columns):
        want = expected_scales(amaxes[:, c].tolist(), length, algo, margin, 448.0)
        torch.testing.assert_close(torch.stack(got)[:, c], torch.tensor(want), rtol=1e-6, atol=0)


def test_delayed_update_with_callables():
    seen = []

    def amax_algo(history):
        seen.append(history.clone())
        return 2 * history[0]

    def sf_algo(a, scale, fp8_max, r):
        return fp8_max / a  # ignores the margin: proves it replaced the default

    r = recipe.DelayedScaling(
        margin=3,
        amax_history_len=2,
        amax_compute_algo=amax_algo,
        scaling_factor_compute_algo=sf_algo,
    )
    history, scale = torch.zeros(2, 1), torch.ones(1)
    history[0] = 4.0
    delayed_update(history, scale, 448.0, r)
    assert seen[0][0, 0] == 4.0
    torch.testing.assert_close(scale, torch.tensor([448.0 / 8.0]))
    assert history.tolist() == [[0.0], [4.0]]


def test_delayed_update_keeps_scale_on_inf_and_nan_and_caps_tiny_amax():
    r = recipe.DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent")
    history, scale = torch.tensor([[float("inf"), float("nan"), 1e-45]]), torch.full((3,), 7.0)
    delayed_update(history, scale, 448.0, r)
    assert scale[0] == 7.0 and scale[1] == 7.0
    assert scale[2] == torch.finfo(torch.float32).max


def test_scale_from_amax_rule():
    a = torch.tensor([2.0, 0.0, float("inf"), 3.0])
    torch.testing.assert_close(
        scale_from_amax(a, 448.0), torch.tensor([224.0, 1.0, 1.0, 448.0 / 3.0])
    )
    pow2 = scale_from_amax(a, 448.0, recipe.QParams(power_2_scale=True))
    torch.testing.assert_close(pow2, torch.tensor([128.0, 1.0, 1.0, 128.0]))
    floor = scale_from_amax(torch.tensor([1e-6]), 448.0, recipe.QParams(amax_epsilon=1.0))
    torch.testing.assert_close(floor, torch.tensor([448.0]))


def test_formats_per_pass():
    assert fp8_dtype(recipe.Format.HYBRID, backward=False) == E4M3
    assert fp8_dtype(recipe.Format.HYBRID, backward=True) == E5M2
    assert fp8_dtype(recipe.Format.E4M3, backward=True) == E4M3


@pytest.mark.parametrize("dtype, mantissa", [(E4M3, 3), (E5M2, 2)])
def test_quantize_rounds_to_the_format_and_saturates(dtype, mantissa):
    x = torch.randn(64, 48) * 3
    x[0, 0] = 1e6  # far beyond the range at this scale: saturates, never NaN or inf
    x[0, 1] = -1e6
    scale = torch.tensor(16.0)  # a power of 2: scaling and unscaling are exact
    q = quantize(x, dtype, scale)
    assert q.data.dtype == dtype and q.data.is_contiguous()
    back = dequantize(q)
    limit = torch.finfo(dtype).max
    assert back[0, 0] == limit / 16.0 and back[0, 1] == -limit / 16.0
    # Elsewhere: round to nearest, relative error at most 2^-(mantissa+1) for normal values.
    scaled = (x * 16.0)[1:]
    normal = scaled.abs() >= torch.finfo(dtype).smallest_normal
    err = ((back[1:] - x[1:]) * 16.0).abs()
    assert torch.all(err[normal] <= scaled.abs()[normal] * 2.0 ** -(mantissa + 1))


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("power_2", [False, True])
def test_block_scales_come_from_each_block(block, power_2):
    x = torch.randn(200, 300) * torch.logspace(-3, 2, 300)  # columns of very different size
    q = quantize_blocks(x, E4M3, block, recipe.QParams(power_2_scale=power_2))
    rows, cols = math.ceil(200 / block[0]), math.ceil(300 / block[1])
    assert q.scale_inv.shape == (rows, cols) and q.data.shape == x.shape
    for i in range(rows):
        for j in range(cols):
            tile = x[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            want = 448.0 / tile.abs().max()
            if power_2:
                want = 2.0 ** math.floor(math.log2(want))
            torch.testing.assert_close(
                1 / q.scale_inv[i, j], torch.as_tensor(want), rtol=1e-6, atol=0
            )
    rel = ((dequantize(q) - x).abs() / x.abs().clamp_min(1e-30))[x.abs() > 1e-2]
    assert rel.max() <= 2.0**-3  # per-block scales keep every column's precision


def test_transposes_are_exact():
    x = torch.randn(256, 384)
    per_tensor = quantize(x, E4M3, torch.tensor(30.0))
    torch.testing.assert_close(dequantize(transpose(per_tensor)), dequantize(per_tensor).t())
    blocks = quantize_blocks(x, E4M3, (128, 128), None)
    torch.testing.assert_close(dequantize(transpose(blocks)), dequantize(blocks).t())
    with pytest.raises(ValueError, match="1x128"):
        transpose(quantize_blocks(x, E4M3, (1, 128), None))


def test_fused_casts_are_bitwise_the_eager_ones(monkeypatch):
    """The compiled cast and amax CUDA runs (`FUSED_CASTS`) against the eager ones, here on the
    CPU's compiler: the same bytes for both formats, with saturated values and a NaN amax, and
    one graph for several shapes."""
    monkeypatch.setattr(scaling, "_fused", lambda t: True)
    g = torch.Generator().manual_seed(11)
    for dtype, scale in ((torch.float8_e4m3fn, 40.0), (torch.float8_e5m2, 8000.0)):
        for shape in ((96, 64), (257, 48)):
            t = (torch.randn(shape, generator=g) * 4).to(torch.bfloat16)
            q = scaling.quantize(t, dtype, torch.tensor(scale))
            want = (
                (t.float() * scale).clamp(-scaling.fp8_max(dtype), scaling.fp8_max(dtype)).to(dtype)
            )
            assert q.data.view(torch.uint8).equal(want.view(torch.uint8)), (dtype, shape)
            assert (q.data.float().abs() == scaling.fp8_max(dtype)).any()  # some saturated
            assert scaling.amax(t).equal(t.abs().amax().float())
    t[3, 5] = float("nan")
    assert scaling.amax(t).isnan()


def test_fused_casts_hold_views_layouts_and_the_recompile_limit(monkeypatch, caplog):
    """The layers cast views of bases shaped differently per layer (activations and gradients
    reshaped to 2-D, QKV column slices, [s, b, h] buffers, transposes): the compiled cast gives
    the eager bytes for each, compiles per layout rather than per base (a view was guarded on
    its base: the ninth base failed a GPT-1.3B step), and past TorchDynamo's recompile limit
    runs eager with a warning instead of failing."""
    import torch._dynamo

    monkeypatch.setattr(scaling, "_fused", lambda t: True)
    monkeypatch.setattr(scaling, "_warned_eager", False)
    torch._dynamo.reset()
    scaling._COMPILED.clear()
    g = torch.Generator().manual_seed(5)

    def views(i):
        b, s, h = 2 + i % 3, 3 + i, 8 * (i + 1)
        yield torch.randn(b, s, h, generator=g).view(-1, h)
        sbh = torch.empty_strided((b, s, h), (h, b * h, 1)).copy_(torch.randn(b, s, h, generator=g))
        yield sbh[0]
        yield torch.randn(b, s, 3 * h, generator=g).view(-1, 3 * h)[:, h : 2 * h]
        yield torch.randn(b * s, 4 * h, generator=g).t()

    # TorchDynamo's own patch: a monkeypatch of its config hides the setting once undone.
    with torch._dynamo.config.patch(recompile_limit=2):
        for i in range(5):
            for view in views(i):
                q = scaling.quantize(view, torch.float8_e4m3fn, torch.tensor(3.0))
                want = (view * 3.0).clamp(-448, 448).to(torch.float8_e4m3fn)
                assert q.data.view(torch.uint8).equal(want.view(torch.uint8)), (i, view.shape)
    torch._dynamo.reset()
    assert "compiled cast failed" in caplog.text  # the limit of 2 was passed: eager took over
