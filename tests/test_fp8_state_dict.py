"""FP8 metadata in checkpoints: TE's `_extra_state` layout written and read back (training goes on
identically), TE-written payloads (2.x pickles naming TE's recipe classes, 1.x `torch.save`)
loading without TE, empty or absent entries, payloads that must be refused, FP8-only weights
(fp8_model_init) in state dicts, and the amax all-reduce over a group."""

from __future__ import annotations

import enum
import io
import pickle
import sys
import types
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from distributed_testing import run_on_ranks
from fp8_testing import amax_reduction_rank

import fusedlayers as te
from fusedlayers import recipe
from fusedlayers.fp8.extra_state import decode_extra_state


def _layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    options = dict(hidden_dropout=0.0, attention_dropout=0.0, use_reference=True)
    return te.TransformerLayer(64, 128, 4, **{**options, **kwargs})


def _train(layer, r, steps, seed=1):
    torch.manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 2, 64)
        with te.fp8_autocast(fp8_recipe=r):
            out = layer(x)
        out.square().mean().backward()
    return out


def _round_trip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_extra_state_round_trip_continues_training_identically():
    r = recipe.DelayedScaling(amax_history_len=5, amax_compute_algo="max")
    source = _layer()
    _train(source, r, steps=3)
    target = _layer(seed=9)
    target.load_state_dict(_round_trip(source.state_dict()), strict=True)
    for name in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        for a, b in ((source.layernorm_mlp, target.layernorm_mlp),
                     (source.self_attention.proj, target.self_attention.proj)):  # fmt: skip
            assert torch.equal(getattr(a.fp8_meta, name), getattr(b.fp8_meta, name)), name
    # The next step casts with the loaded scales: bit-identical results.
    assert torch.equal(_train(source, r, 1, seed=5), _train(target, r, 1, seed=5))


def test_extra_state_has_te_layout():
    r = recipe.DelayedScaling(amax_history_len=7)
    layer = _layer()
    _train(layer, r, steps=1)
    state = layer.state_dict()
    mlp = decode_extra_state(state["layernorm_mlp._extra_state"])
    assert mlp["scale_fwd"].shape == (6,) and mlp["amax_history_fwd"].shape == (7, 6)
    assert mlp["scale_bwd"].shape == (4,) and mlp["amax_history_bwd"].shape == (7, 4)
    assert mlp["extra_fp8_variables"]["num_gemms"] == 2 and mlp["recipe"] == r
    proj = decode_extra_state(state["self_attention.proj._extra_state"])
    assert proj["scale_fwd"].shape == (3,) and proj["scale_bwd"].shape == (2,)
    # Payloads are plain pickles of CPU tensors, like TE 2.x's.
    assert state["layernorm_mlp._extra_state"].dtype == torch.uint8
    current = _layer()
    _train(current, recipe.Float8CurrentScaling(), steps=1)
    only_recipe = decode_extra_state(current.state_dict()["layernorm_mlp._extra_state"])
    assert "scale_fwd" not in only_recipe and only_recipe["recipe"].float8_current_scaling()


def _fake_transformer_engine():
    """Classes named as TE's (transformer_engine.common.recipe), pickled under TE's path."""

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(448, 448)
        HYBRID = _FormatHelper(448, 57344)

    @dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"
        scaling_factor_compute_algo: object = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False
        backward_override: object = None  # a newer TE field fusedlayers does not have

    module = types.ModuleType("transformer_engine.common.recipe")
    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__ = module.__name__
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    return module


def test_te_written_fp8_checkpoint_loads_without_te(monkeypatch):
    fake = _fake_transformer_engine()
    for name in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    length = 16
    te_state = {
        "recipe": fake.DelayedScaling(margin=1, amax_history_len=length),
        "scale_fwd": torch.rand(6) + 1,
        "amax_history_fwd": torch.rand(length, 6),
        "scale_bwd": torch.rand(4) + 1,
        "amax_history_bwd": torch.rand(length, 4),
        "extra_fp8_variables": {"num_gemms": 2, "fp8_checkpoint": True},
    }
    payload = torch.frombuffer(bytearray(pickle.dumps(te_state)), dtype=torch.uint8)
    monkeypatch.delitem(sys.modules, fake.__name__)  # TE is not installed where it loads
    layer = _layer()
    state = layer.state_dict()
    state["layernorm_mlp._extra_state"] = payload
    state["self_attention.core_attention._extra_state"] = payload  # FP8 attention metadata
    layer.load_state_dict(state, strict=True)
    meta = layer.layernorm_mlp.fp8_meta
    assert torch.equal(meta.scale_fwd, te_state["scale_fwd"])
    assert torch.equal(meta.amax_history_bwd, te_state["amax_history_bwd"])
    assert isinstance(meta.recipe, recipe.DelayedScaling)
    assert meta.recipe.margin == 1 and meta.recipe.fp8_format is recipe.Format.HYBRID
    # Training goes on from the loaded scales (same history length: nothing reset).
    _train(layer, recipe.DelayedScaling(margin=1, amax_history_len=length), steps=1)
    assert meta.amax_history_fwd.shape == (length, 6)


def test_te1_torch_save_payload_loads():
    te1 = {
        "scale_fwd": torch.full((3,), 2.0),
        "scale_inv_fwd": torch.full((3,), 0.5),
        "amax_history_fwd": torch.ones(4, 3),
        "scale_bwd": torch.full((2,), 3.0),
        "scale_inv_bwd": torch.full((2,), 1 / 3),
        "amax_history_bwd": torch.ones(4, 2),
        "extra_fp8_variables": {"num_gemms": 1},
    }
    buffer = io.BytesIO()
    torch.save(te1, buffer)
    layer = te.Linear(32, 16)
    state = layer.state_dict()
    state["_extra_state"] = buffer
    layer.load_state_dict(state)
    assert torch.equal(layer.fp8_meta.scale_bwd, te1["scale_bwd"])
    assert layer.fp8_meta.recipe == recipe.DelayedScaling(amax_history_len=4)


@pytest.mark.parametrize("extra", ["empty", "none", "absent", "pickled_none", "saved_none"])
def test_empty_or_absent_extra_state_is_accepted(extra):
    layer = te.LayerNormMLP(32, 64)
    state = layer.state_dict()
    saved_none = io.BytesIO()
    torch.save(None, saved_none)
    payloads = {
        "empty": torch.empty(0, dtype=torch.uint8),
        "none": None,
        "pickled_none": torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8),
        "saved_none": saved_none,
    }
    if extra == "absent":
        del state["_extra_state"]
        layer.load_state_dict(state, strict=False)
    else:
        state["_extra_state"] = payloads[extra]
        layer.load_state_dict(state, strict=True)
    assert layer.fp8_meta.recipe is None and layer.get_extra_state().numel() == 0


class _Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize(
    "payload, message",
    [
        (pickle.dumps({"recipe": _Exploit()}), "not allowed"),
        (pickle.dumps([1, 2, 3]), "holds a list"),
        (b"\x80\x04garbage", "cannot read"),
        (pickle.dumps({"scale_fwd": torch.ones(6), "amax_history_fwd": torch.ones(2, 6)}), "6"),
    ],
)
def test_bad_extra_state_is_refused(payload, message, capsys):
    layer = te.Linear(32, 16)
    state = layer.state_dict()
    state["_extra_state"] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        layer.load_state_dict(state)
    assert "must never run" not in capsys.readouterr().out


def test_fp8_model_init_keeps_weights_in_fp8(monkeypatch):
    torch.manual_seed(0)
    reference = te.LayerNormMLP(64, 128, use_reference=True)
    torch.manual_seed(0)
    with te.fp8_model_init(enabled=True, preserve_high_precision_init_val=True):
        mlp = te.LayerNormMLP(64, 128, use_reference=True)
    for name in ("fc1_weight", "fc2_weight"):
        weight = getattr(mlp, name)
        assert weight.dtype == torch.float8_e4m3fn and not weight.requires_grad
        assert torch.equal(weight.get_high_precision_init_val(), getattr(reference, name))
        weight.clear_high_precision_init_val()
        assert weight.get_high_precision_init_val() is None
    state = mlp.state_dict()
    assert state["fc1_weight"].dtype == torch.float32
    torch.testing.assert_close(state["fc1_weight"], reference.fc1_weight, rtol=2**-4, atol=1e-4)
    x = torch.randn(16, 64, requires_grad=True)
    want = reference(x)
    torch.testing.assert_close(mlp(x), want, rtol=0.05, atol=0.02)  # weights dequantized
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        got = mlp(x)
    got.sum().backward()  # the input still gets its gradient; the FP8 weights do not train
    assert x.grad is not None and mlp.fc1_weight.grad is None
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    mlp.to(torch.float64)  # FP8 weights keep their bytes; the rest is cast
    assert mlp.fc1_weight.dtype == torch.float8_e4m3fn
    assert mlp.layer_norm_weight.dtype == torch.float64
    torch.testing.assert_close(mlp.state_dict()["fc2_weight"], state["fc2_weight"])
    with pytest.raises(RuntimeError, match="fp8_model_init"):
        with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
            mlp(x.double())


def test_fp8_model_init_state_dicts_move_both_ways():
    torch.manual_seed(1)
    plain = _layer(fuse_qkv_params=True)
    with te.quantized_model_init():
        fp8 = _layer(seed=2, fuse_qkv_params=True)
    qkv = fp8.self_attention.layernorm_qkv
    assert qkv.weight.dtype == torch.float8_e4m3fn
    fp8.load_state_dict(_round_trip(plain.state_dict()), strict=True)
    for key, value in fp8.state_dict().items():
        if key.endswith("weight") and value.dim() == 2:
            torch.testing.assert_close(value, plain.state_dict()[key], rtol=2**-4, atol=1e-3)
    back = _layer(seed=3, fuse_qkv_params=True)
    back.load_state_dict(_round_trip(fp8.state_dict()), strict=True)
    x = torch.randn(16, 2, 64)
    torch.testing.assert_close(back(x), fp8(x))


@pytest.mark.parametrize("reduce_amax, new_group", [(True, False), (True, True), (False, False)])
def test_amaxes_are_reduced_over_the_group(reduce_amax, new_group):
    ranks = run_on_ranks(2, amax_reduction_rank, reduce_amax, new_group)
    for key, column, fp8_max in (("x", 0, 448.0), ("w", 1, 448.0)):
        for rank in ranks:
            local = rank[f"amax_{key}"]
            global_max = max(r[f"amax_{key}"] for r in ranks)
            want = fp8_max / (global_max if reduce_amax else local)
            assert rank["scale_fwd"][column] == pytest.approx(want, rel=1e-6)
    for rank in ranks:
        amax_dy = max(r["amax_dy"] for r in ranks) if reduce_amax else rank["amax_dy"]
        assert rank["scale_bwd"][0] == pytest.approx(57344.0 / amax_dy, rel=1e-6)
