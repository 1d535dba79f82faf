"""FP8 recipes: TransformerEngine's defaults and field names, validation errors naming the field,
the Blackwell-only recipes refusing to run, and the autocast's recipe checks."""

from __future__ import annotations

import logging

import pytest
import torch

import fusedlayers as te
from fusedlayers import recipe
from fusedlayers.fp8 import context


def test_format_maxima_and_names():
    assert recipe.Format.E4M3.value == (448.0, 448.0)
    assert recipe.Format.E5M2.value == (57344.0, 57344.0)
    assert recipe.Format.HYBRID.value.max_fwd == torch.finfo(torch.float8_e4m3fn).max
    assert recipe.Format.HYBRID.value.max_bwd == torch.finfo(torch.float8_e5m2).max
    assert recipe.Format.E2M1.value == (6.0, 6.0)


def test_delayed_scaling_defaults_are_te_defaults():
    r = recipe.DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (
        0,
        recipe.Format.HYBRID,
        1024,
        "max",
    )
    assert r.scaling_factor_compute_algo is None
    assert (r.reduce_amax, r.fp8_dpa, r.fp8_mha) == (True, False, False)
    assert r.delayed() and r.float8_per_tensor_scaling() and not r.float8_block_scaling()


def test_current_and_block_scaling_defaults(monkeypatch):
    monkeypatch.delenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", raising=False)
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    current = recipe.Float8CurrentScaling()
    assert current.fp8_format is recipe.Format.HYBRID
    assert current.fp8_quant_fwd_inp == recipe.QParams(power_2_scale=False, amax_epsilon=0.0)
    assert not current.fp8_gemm_fprop.use_split_accumulator
    assert current.fp8_gemm_dgrad.use_split_accumulator
    assert current.fp8_gemm_wgrad.use_split_accumulator
    assert current.float8_current_scaling() and not current.delayed()
    block = recipe.Float8BlockScaling()
    assert block.fp8_format is recipe.Format.E4M3
    assert (block.x_block_scaling_dim, block.w_block_scaling_dim, block.grad_block_scaling_dim) == (
        1,
        2,
        1,
    )
    assert block.fp8_quant_fwd_weight.power_2_scale  # powers of 2 unless FP32 scales are asked
    assert block.float8_block_scaling()
    assert recipe.MXFP8BlockScaling().fp8_format is recipe.Format.E4M3
    nvfp4 = recipe.NVFP4BlockScaling()
    assert (nvfp4.fp4_format, nvfp4.fp8_format) == (recipe.Format.E2M1, recipe.Format.E4M3)
    assert nvfp4.nvfp4() and recipe.MXFP8BlockScaling.mxfp8()


def test_environment_switches_scale_kinds(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert recipe.Float8CurrentScaling().fp8_quant_bwd_grad.power_2_scale
    assert not recipe.Float8BlockScaling().fp8_quant_fwd_inp.power_2_scale


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: recipe.DelayedScaling(margin=-1), "margin"),
        (lambda: recipe.DelayedScaling(margin=1.5), "margin"),
        (lambda: recipe.DelayedScaling(fp8_format=recipe.Format.E5M2), "fp8_format"),
        (lambda: recipe.DelayedScaling(fp8_format="HYBRID"), "fp8_format"),
        (lambda: recipe.DelayedScaling(amax_history_len=0), "amax_history_len"),
        (lambda: recipe.DelayedScaling(amax_compute_algo="mean"), "amax_compute_algo"),
        (lambda: recipe.DelayedScaling(scaling_factor_compute_algo=3), "scaling_factor"),
        (lambda: recipe.DelayedScaling(reduce_amax="yes"), "reduce_amax"),
        (lambda: recipe.Float8CurrentScaling(fp8_format=recipe.Format.E5M2), "fp8_format"),
        (lambda: recipe.Float8BlockScaling(x_block_scaling_dim=3), "x_block_scaling_dim"),
        (
            lambda: recipe.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=2),
            "x_block_scaling_dim and w_block_scaling_dim",
        ),
        (lambda: recipe.Float8BlockScaling(fp8_dpa=True), "fp8_dpa"),
        (
            lambda: recipe.Float8BlockScaling(fp8_gemm_dgrad=recipe.MMParams(False)),
            "fp8_gemm_dgrad",
        ),
        (lambda: recipe.NVFP4BlockScaling(fp8_format=recipe.Format.HYBRID), "fp8_format"),
    ],
)
def test_bad_recipe_fields_raise_naming_them(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_callable_amax_compute_algo_is_accepted():
    r = recipe.DelayedScaling(amax_compute_algo=lambda history: history.mean(dim=0))
    assert callable(r.amax_compute_algo)


@pytest.mark.parametrize("make", [recipe.MXFP8BlockScaling, recipe.NVFP4BlockScaling])
def test_blackwell_recipes_raise_naming_the_architecture(make):
    r = make()  # building one is fine (a checkpoint may hold it)
    with pytest.raises(RuntimeError, match=r"Blackwell.*sm_100"):
        with te.fp8_autocast(enabled=True, fp8_recipe=r):
            pass
    with pytest.raises(RuntimeError, match=r"Blackwell.*sm_100"):
        with te.autocast(recipe=r):
            pass
    with pytest.raises(RuntimeError, match="Blackwell"):
        with te.quantized_model_init(recipe=r):
            pass
    with te.fp8_autocast(enabled=False, fp8_recipe=r):  # nothing runs in FP8: no error
        pass


def test_autocast_rejects_a_non_recipe():
    with pytest.raises(TypeError, match="recipe"):
        with te.fp8_autocast(fp8_recipe="delayed"):
            pass


def test_fp8_attention_flags_log_once(caplog, monkeypatch):
    monkeypatch.setattr(context, "_warned_fp8_attention", False)
    with caplog.at_level(logging.WARNING, logger="fusedlayers"):
        for _ in range(2):
            with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
                pass
    messages = [r.getMessage() for r in caplog.records if "fp8_dpa" in r.getMessage()]
    assert len(messages) == 1 and "not implemented" in messages[0]


def test_is_fp8_available_follows_te_signature():
    available = te.is_fp8_available()
    assert isinstance(available, bool)
    ok, reason = te.is_fp8_available(return_reason=True)
    assert ok == available
    if not torch.cuda.is_available():
        assert not ok and "CUDA" in reason


def test_recipe_module_is_reachable_as_te_users_import_it():
    import fusedlayers.recipe as recipe_by_path
    from fusedlayers import recipe as recipe_by_name

    assert recipe_by_path is recipe_by_name is te.recipe
    assert te.fp8.fp8_autocast is te.fp8_autocast
