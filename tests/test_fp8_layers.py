"""The GEMM modules inside fp8_autocast, on the emulated (reference) path: outputs and gradients
against fp64 within bounds derived from the formats' precision, the formats each pass uses, the
delayed-scaling history through real steps, is_first_microbatch, calibration, nesting, the
errors (no GPU, bad shapes) and a TE training snippet with only the import changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_testing import CastRecorder, assert_within, cast_error, current_scale, gemm_bound
from test_fp8_scaling import expected_scales

import fusedlayers as te
from fusedlayers import ArgumentError, recipe
from fusedlayers.fp8.state import STATE

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _grad_dtype(fmt):
    return E5M2 if fmt is recipe.Format.HYBRID else E4M3


@pytest.mark.parametrize("fmt", [recipe.Format.HYBRID, recipe.Format.E4M3])
def test_linear_current_scaling_within_fp8_bounds(fmt):
    torch.manual_seed(0)
    m, k, n = 48, 64, 32
    layer = te.Linear(k, n, use_reference=True)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(m, k, requires_grad=True)
    dy = torch.randn(m, n)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling(fp8_format=fmt)):
        y = layer(x)
    y.backward(dy)
    w, b, g = layer.weight.detach(), layer.bias.detach(), _grad_dtype(fmt)
    ex, ew = (
        cast_error(x, E4M3, current_scale(x, E4M3)),
        cast_error(w, E4M3, current_scale(w, E4M3)),
    )
    edy = cast_error(dy, g, current_scale(dy, g))
    xd, wd, dyd = x.detach().double(), w.double(), dy.double()
    err = assert_within(y, xd @ wd.t() + b.double(), gemm_bound(xd, ex, wd, ew), "forward")
    assert err > 1e-4, "the forward ran in high precision, not FP8"
    assert_within(x.grad, dyd @ wd, gemm_bound(dyd, edy, wd.t(), ew.t()), "dgrad")
    assert_within(
        layer.weight.grad, dyd.t() @ xd, gemm_bound(dyd.t(), edy.t(), xd.t(), ex.t()), "wgrad"
    )  # noqa: E501
    torch.testing.assert_close(layer.bias.grad, dy.sum(0))


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_within_fp8_bounds(normalization):
    torch.manual_seed(1)
    layer = te.LayerNormLinear(64, 48, normalization=normalization, use_reference=True)
    x = torch.randn(4, 8, 64, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = layer(x)
    norm = F.layer_norm if normalization == "LayerNorm" else F.rms_norm
    ln = norm(x.detach().double(), (64,)).reshape(-1, 64)
    w = layer.weight.detach()
    ln_fp32 = ln.float()
    bound = gemm_bound(
        ln, cast_error(ln, E4M3, current_scale(ln_fp32, E4M3)) + 1e-6 * ln.abs(), w.double(),
        cast_error(w, E4M3, current_scale(w, E4M3)),
    )  # fmt: skip
    assert_within(y.reshape(-1, 48), ln @ w.double().t() + layer.bias.double(), bound, "output")


def test_layernorm_mlp_within_fp8_bounds():
    """Two GEMMs with GELU between them (slope at most 1.13): FC1's error bound carries into the
    hidden activations, which FC2 casts again."""
    torch.manual_seed(2)
    mlp = te.LayerNormMLP(64, 96, use_reference=True)
    with torch.no_grad():
        mlp.fc1_bias.normal_()
    x = torch.randn(32, 64)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = mlp(x)
    ln = F.layer_norm(x.double(), (64,))
    w1, w2 = mlp.fc1_weight.detach(), mlp.fc2_weight.detach()
    pre = ln @ w1.double().t() + mlp.fc1_bias.double()
    b1 = gemm_bound(
        ln, cast_error(ln, E4M3, current_scale(ln.float(), E4M3)) + 1e-6 * ln.abs(), w1.double(),
        cast_error(w1, E4M3, current_scale(w1, E4M3)),
    )  # fmt: skip
    hidden = F.gelu(pre, approximate="tanh")
    hidden_err = 1.13 * b1
    hidden_max = (hidden.abs() + hidden_err).max()
    h_cast = cast_error(hidden.abs() + hidden_err, E4M3, 448.0 / hidden_max.item() * 0.99)
    b2 = gemm_bound(
        hidden.abs() + hidden_err, hidden_err + h_cast, w2.double(),
        cast_error(w2, E4M3, current_scale(w2, E4M3)),
    )  # fmt: skip
    want = hidden @ w2.double().t() + mlp.fc2_bias.double()
    assert_within(y, want, b2, "output")


def test_hybrid_casts_e4m3_forward_e5m2_gradients(monkeypatch):
    rec = CastRecorder().install(monkeypatch)
    layer = te.LayerNormMLP(32, 64, use_reference=True)
    x = torch.randn(16, 32, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID)):
        y = layer(x)
    y.sum().backward()
    assert rec.dtypes("input") == {E4M3} and rec.dtypes("weight") == {E4M3}
    assert rec.dtypes("grad_output") == {E5M2}
    assert rec.count("input") == 2 and rec.count("grad_output") == 2  # FC1 and FC2
    rec.casts.clear()
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_format=recipe.Format.E4M3)):
        y = layer(x)
    y.sum().backward()
    assert {d for _, d in rec.casts} == {E4M3}


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_history_through_training_steps(algo):
    """Scales after each step follow the window of the amaxes the layer saw (forward: input and
    weight, E4M3 max; backward: grad_output, E5M2 max), with the margin."""
    torch.manual_seed(3)
    layer = te.Linear(32, 16, use_reference=True)
    r = recipe.DelayedScaling(margin=1, amax_history_len=3, amax_compute_algo=algo)
    seen = {"x": [], "w": [], "dy": []}
    for step in range(6):
        x = torch.randn(16, 32) * (1 + step % 3)
        dy = torch.randn(16, 16) * 10.0 ** (step % 2)
        with te.fp8_autocast(fp8_recipe=r):
            y = layer(x)
        y.backward(dy)
        seen["x"].append(x.abs().max().item())
        seen["w"].append(layer.weight.abs().max().item())
        seen["dy"].append(dy.abs().max().item())
        meta = layer.fp8_meta
        want_x = expected_scales(seen["x"], 3, algo, 1, 448.0)[-1]
        want_w = expected_scales(seen["w"], 3, algo, 1, 448.0)[-1]
        want_dy = expected_scales(seen["dy"], 3, algo, 1, 57344.0)[-1]
        torch.testing.assert_close(meta.scale_fwd[:2], torch.tensor([want_x, want_w]))
        torch.testing.assert_close(meta.scale_bwd[0], torch.tensor(want_dy))
        assert meta.scale_fwd[2] == 1 and meta.scale_bwd[1] == 1  # output slots stay unused


def test_delayed_scaling_casts_with_the_previous_steps_scale():
    torch.manual_seed(4)
    layer = te.Linear(64, 32, bias=False, use_reference=True)
    r = recipe.DelayedScaling(amax_history_len=4)
    with te.fp8_autocast(fp8_recipe=r):
        layer(torch.randn(16, 64) * 4)
    scale_x, scale_w = layer.fp8_meta.scale_fwd[0].item(), layer.fp8_meta.scale_fwd[1].item()
    x = torch.randn(16, 64)  # smaller than step 1's: its own scale would differ
    with te.fp8_autocast(fp8_recipe=r):
        y = layer(x)

    def cast(t, s):
        return (t * s).clamp(-448, 448).to(E4M3).float() / s

    want = cast(x, scale_x) @ cast(layer.weight.detach(), scale_w).t()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make_recipe", [recipe.Float8CurrentScaling, recipe.DelayedScaling])
def test_is_first_microbatch_caches_the_fp8_weight(monkeypatch, make_recipe):
    rec = CastRecorder().install(monkeypatch)
    torch.manual_seed(5)
    layer = te.Linear(32, 16, use_reference=True)
    x = torch.randn(16, 32)
    r = make_recipe()
    with te.fp8_autocast(fp8_recipe=r):
        first = layer(x, is_first_microbatch=True)
        assert rec.count("weight") == 1
        with torch.no_grad():
            layer.weight.add_(1.0)  # a changed weight shows which one the GEMM used
        reused = layer(x.requires_grad_(), is_first_microbatch=False)
        assert rec.count("weight") == 1, "is_first_microbatch=False cast the weight again"
        fresh = layer(x, is_first_microbatch=None)
        assert rec.count("weight") == 2
    torch.testing.assert_close(reused, first)
    assert (fresh - first).abs().max() > 0.5
    reused.sum().backward()  # the cached weight still gets its gradient
    assert layer.weight.grad is not None and x.grad is not None
    layer.weight.grad = None
    with te.fp8_autocast(fp8_recipe=r):  # one block: the same delayed scales for both
        recast = layer(x, is_first_microbatch=True)
        uncached = layer(x, is_first_microbatch=None)
    torch.testing.assert_close(recast, uncached)
    assert rec.count("weight") == 4


def test_is_first_microbatch_through_a_transformer_layer(monkeypatch):
    rec = CastRecorder().install(monkeypatch)
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0)
    layer.use_reference = True
    x = torch.randn(16, 2, 64)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        a = layer(x, is_first_microbatch=True)
        assert rec.count("weight") == 4  # qkv, proj, fc1, fc2
        b = layer(x, is_first_microbatch=False)
        assert rec.count("weight") == 4
    torch.testing.assert_close(a, b)


def test_calibration_records_amaxes_without_fp8():
    torch.manual_seed(6)
    layer = te.Linear(32, 16, use_reference=True)
    x = torch.randn(8, 32) * 3
    r = recipe.DelayedScaling(amax_history_len=2)
    with torch.no_grad(), te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=r):
        y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    meta = layer.fp8_meta
    torch.testing.assert_close(meta.scale_fwd[0], 448.0 / x.abs().max())
    torch.testing.assert_close(meta.scale_fwd[1], 448.0 / layer.weight.abs().max())
    assert meta.amax_history_fwd[1, 0] == x.abs().max()  # rolled out of the current slot
    assert layer.get_extra_state().numel() > 0  # a checkpoint now carries the scales


def test_autocast_nests_and_restores():
    torch.manual_seed(7)
    layer = te.Linear(32, 16, use_reference=True)
    x = torch.randn(16, 32)
    outer, inner = recipe.DelayedScaling(amax_history_len=4), recipe.Float8CurrentScaling()
    with te.fp8_autocast(fp8_recipe=outer):
        assert STATE.enabled and STATE.recipe is outer and STATE.depth == 1
        with te.fp8_autocast(enabled=False):
            assert not STATE.enabled and STATE.depth == 2
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert STATE.enabled and STATE.recipe is outer
        with te.autocast(recipe=inner):
            assert STATE.recipe is inner
        layer(x)
        assert torch.all(layer.fp8_meta.scale_fwd == 1), "scales update at the outermost exit"
    assert layer.fp8_meta.scale_fwd[0] == 448.0 / x.abs().max()
    assert (STATE.enabled, STATE.calibrating, STATE.recipe, STATE.depth, STATE.step) == (
        False, False, None, 0, None,
    )  # fmt: skip
    with pytest.raises(KeyError), te.fp8_autocast(fp8_recipe=outer):
        raise KeyError("inside")
    assert not STATE.enabled and STATE.depth == 0 and STATE.recipe is None


def test_fp8_on_cpu_without_the_reference_path_raises():
    layer = te.Linear(32, 16)
    with pytest.raises(RuntimeError, match=r"8\.9.*use_reference=True"):
        with te.fp8_autocast():
            layer(torch.randn(16, 32))
    with te.fp8_autocast(), te.reference_mode():
        assert layer(torch.randn(16, 32)).shape == (16, 16)


def test_shapes_fp8_gemms_cannot_take_raise_naming_them():
    with pytest.raises(ArgumentError, match=r"K=40"), te.fp8_autocast():
        te.Linear(40, 32, use_reference=True)(torch.randn(16, 40))
    with pytest.raises(ArgumentError, match=r"N=24"), te.fp8_autocast():
        te.Linear(32, 24, use_reference=True)(torch.randn(16, 32))
    layer = te.Linear(32, 16, use_reference=True)
    with pytest.raises(ArgumentError, match=r"M=10"), te.fp8_autocast():
        layer(torch.randn(10, 32))
    with torch.no_grad(), te.fp8_autocast():  # no weight gradient: any token count
        assert layer(torch.randn(10, 32)).shape == (10, 16)


@pytest.mark.parametrize(
    "make_recipe", [recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.Float8BlockScaling]
)
def test_transformer_layer_close_to_high_precision(make_recipe):
    torch.manual_seed(8)
    layer = te.TransformerLayer(
        128, 256, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
        fuse_qkv_params=True, params_dtype=torch.float64, use_reference=True,
    )  # fmt: skip
    x = torch.randn(32, 2, 128, dtype=torch.float64, requires_grad=True)
    want = layer(x)
    (gx_want,) = torch.autograd.grad(want.square().sum(), x)
    for _ in range(2):  # the second step runs on scales from the first (delayed scaling)
        with te.fp8_autocast(fp8_recipe=make_recipe()):
            got = layer(x)
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    rel = (got - want).norm() / want.norm()
    rel_grad = (gx - gx_want).norm() / gx_want.norm()
    assert 1e-4 < rel < 0.03, rel  # FP8 ran, within a few units of E4M3's 2^-4
    assert 1e-4 < rel_grad < 0.1, rel_grad


def test_te_fp8_training_snippet_runs_with_only_the_import_changed():
    import fusedlayers as te  # was: import transformer_engine.pytorch as te
    from fusedlayers import recipe  # was: from transformer_engine.common import recipe

    torch.manual_seed(0)
    hidden, ffn, heads = 128, 512, 4
    model = te.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fp8_recipe = recipe.DelayedScaling(
        fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"
    )
    x = torch.randn(64, 4, hidden)
    losses = []
    with te.reference_mode():  # the CPU has no FP8 GEMMs: emulate them
        for _ in range(4):
            with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
                out = model(x)
            loss = out.square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.layernorm_mlp.fp8_meta.amax_history_fwd.shape == (16, 6)
