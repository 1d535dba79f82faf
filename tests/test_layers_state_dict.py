"""Checkpoint compatibility: TransformerEngine's key names for every configuration, TE state dicts
(with their `_extra_state` entries) loading with strict=True, conversions between the three QKV
storage forms for every pair, and the `use_reference` switch across a model."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from fusedlayers import reference_mode
from fusedlayers.fp8.extra_state import decode_extra_state
from fusedlayers.layers.multihead_attention import MultiheadAttention
from fusedlayers.layers.transformer_layer import TransformerLayer
from fusedlayers.reference_switch import ReferenceSwitch

HIDDEN, FFN, HEADS, GROUPS = 32, 48, 4, 2
FORMS = {"separate": (False, True), "interleaved": (True, True), "concat": (True, False)}


def make_layer(form="separate", seed=0, **kwargs):
    torch.manual_seed(seed)
    fused, interleaved = FORMS[form]
    options = dict(
        num_gqa_groups=GROUPS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        fuse_qkv_params=fused,
        qkv_weight_interleaved=interleaved,
        params_dtype=torch.float64,
    )
    options.update(kwargs)
    layer = TransformerLayer(HIDDEN, FFN, HEADS, **options)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def _keys(prefix, names):
    return {f"{prefix}.{n}" for n in names}


QKV_SEPARATE = [
    "query_weight",
    "query_bias",
    "key_weight",
    "key_bias",
    "value_weight",
    "value_bias",
]
LN = ["layer_norm_weight", "layer_norm_bias"]
MLP = LN + ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "_extra_state"]
PROJ = ["weight", "bias", "_extra_state"]


def te_keys(config: str) -> set[str]:
    """The keys TE's TransformerLayer saves, per configuration (from TE's module structure)."""
    keys = _keys("self_attention.proj", PROJ) | _keys("layernorm_mlp", MLP)
    if config == "output_layernorm":
        keys |= _keys("self_attention.qkv", QKV_SEPARATE + ["_extra_state"])
        return keys | {"layernorm.weight", "layernorm.bias"}
    if config == "fused":
        return keys | _keys("self_attention.layernorm_qkv", LN + ["weight", "bias", "_extra_state"])
    keys |= _keys("self_attention.layernorm_qkv", LN + QKV_SEPARATE + ["_extra_state"])
    if config == "rmsnorm":
        return {k for k in keys if not k.endswith("layer_norm_bias")}
    if config == "no_bias":
        # `bias=False` drops the linear biases; the LayerNorm keeps its beta.
        return {k for k in keys if not k.endswith("bias") or k.endswith("layer_norm_bias")}
    if config == "decoder":
        keys |= _keys("inter_attention.layernorm_query", LN + ["query_weight", "query_bias"])
        keys |= _keys("inter_attention.layernorm_query", ["_extra_state"])
        kv = ["key_weight", "key_bias", "value_weight", "value_bias", "_extra_state"]
        keys |= _keys("inter_attention.key_value", kv) | _keys("inter_attention.proj", PROJ)
    return keys


CONFIGS = {
    "default": {},
    "fused": dict(fuse_qkv_params=True),
    "rmsnorm": dict(normalization="RMSNorm"),
    "no_bias": dict(bias=False),
    "output_layernorm": dict(output_layernorm=True),
    "decoder": dict(layer_type="decoder"),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_te_key_names(config):
    layer = TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, **CONFIGS[config])
    assert set(layer.state_dict()) == te_keys(config)


def _te_extra_states():
    """`_extra_state` payloads TE writes without FP8, across versions."""
    saved_none = io.BytesIO()
    torch.save(None, saved_none)
    as_tensor = torch.frombuffer(bytearray(saved_none.getvalue()), dtype=torch.uint8)
    pickled_none = torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8)
    return [torch.empty(0, dtype=torch.uint8), pickled_none, as_tensor, saved_none, None]


@pytest.mark.parametrize("extra", range(5))
@pytest.mark.parametrize("config", ["default", "decoder", "output_layernorm"])
def test_te_checkpoint_loads_strict(config, extra):
    """A state dict with TE's keys, shapes and extra state loads unchanged, values in place."""
    layer = TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, **CONFIGS[config])
    state = {}
    for key, value in layer.state_dict().items():
        state[key] = (
            _te_extra_states()[extra] if key.endswith("_extra_state") else torch.randn_like(value)
        )
    # TE 2.x also checkpoints DotProductAttention's (FP8) extra state.
    state["self_attention.core_attention._extra_state"] = torch.empty(0, dtype=torch.uint8)
    layer.load_state_dict(state, strict=True)
    for key, value in layer.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(value, state[key]), key


def test_extra_state_that_is_not_fp8_metadata_is_refused():
    """FP8 metadata loads (tests/test_fp8_state_dict.py); a payload that is not (here a pickled
    string) raises, for the modules and for the attention's entry."""
    payload = torch.frombuffer(bytearray(pickle.dumps("DelayedScaling")), dtype=torch.uint8)
    layer = TransformerLayer(HIDDEN, FFN, HEADS)
    state = layer.state_dict()
    state["layernorm_mlp._extra_state"] = payload
    with pytest.raises(ValueError, match="FP8 metadata"):
        layer.load_state_dict(state)
    state = layer.state_dict()
    state["self_attention.core_attention._extra_state"] = payload
    with pytest.raises(ValueError, match="FP8 metadata"):
        layer.load_state_dict(state)
    for state in _te_extra_states():
        assert decode_extra_state(state) is None


@pytest.mark.parametrize("src", list(FORMS))
@pytest.mark.parametrize("dst", list(FORMS))
@pytest.mark.parametrize("layer_type", ["encoder", "decoder"])
def test_storage_forms_round_trip(src, dst, layer_type):
    """Save in one QKV form, load into a layer built with another: same function."""
    source = make_layer(src, seed=0, layer_type=layer_type)
    target = make_layer(dst, seed=1, layer_type=layer_type)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)  # the storage form travels in the metadata
    buffer.seek(0)
    target.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    x = torch.randn(5, 2, HIDDEN, dtype=torch.float64)
    enc = torch.randn(7, 2, HIDDEN, dtype=torch.float64)
    kwargs = dict(encoder_output=enc) if layer_type == "decoder" else {}
    torch.testing.assert_close(target(x, **kwargs), source(x, **kwargs), atol=1e-12, rtol=0)
    back = make_layer(src, seed=2, layer_type=layer_type)
    back.load_state_dict(target.state_dict(), strict=True)
    for key, value in source.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(back.state_dict()[key], value), key


@pytest.mark.parametrize("dst", list(FORMS))
def test_fused_weight_without_record_follows_te(dst):
    """Without the metadata record (TE checkpoints, safetensors) a fused `weight` is read in the
    target's fused layout, or TE's default interleaved layout for a separate target."""
    source_form = "interleaved" if dst == "separate" else dst
    source = make_layer(source_form, seed=0)
    plain = dict(source.state_dict())  # a plain dict carries no metadata
    target = make_layer(dst, seed=1)
    target.load_state_dict(plain, strict=True)
    x = torch.randn(5, 2, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(target(x), source(x), atol=1e-12, rtol=0)


def test_separate_params_stay_one_buffer_after_load():
    layer = make_layer("separate")
    layer.load_state_dict(make_layer("interleaved", seed=3).state_dict())
    qkv = layer.self_attention.layernorm_qkv
    assert qkv.joined_weight().data_ptr() == qkv.query_weight.data_ptr()
    assert qkv.key_weight.data_ptr() == qkv.query_weight.data_ptr() + HEADS * 8 * HIDDEN * 8


def _switches(module):
    return {
        name: m.use_reference
        for name, m in module.named_modules()
        if isinstance(m, ReferenceSwitch)
    }


def test_use_reference_propagates():
    layer = TransformerLayer(HIDDEN, FFN, HEADS, layer_type="decoder", use_reference=True)
    switches = _switches(layer)
    assert "self_attention.core_attention" in switches and "layernorm_mlp" in switches
    assert all(switches.values())
    layer.use_reference = False
    assert not any(_switches(layer).values())
    layer.self_attention.use_reference = True
    assert layer.self_attention.core_attention.use_reference
    assert not layer.inter_attention.core_attention.use_reference
    mha = MultiheadAttention(HIDDEN, HEADS, use_reference=True)
    assert mha.core_attention.use_reference and mha.proj.use_reference


def test_reference_mode_reaches_attention():
    layer = TransformerLayer(HIDDEN, FFN, HEADS)
    assert not layer.self_attention.core_attention.reference_active
    with reference_mode():
        assert layer.self_attention.core_attention.reference_active
        assert layer.layernorm_mlp.reference_active


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_whole_module_copies_keep_buffers_and_hooks(how):
    """deepcopy / torch.save of a module keep split parameters in one buffer and keep the
    storage-form hooks working."""
    layer = make_layer("separate")
    if how == "deepcopy":
        clone = copy.deepcopy(layer)
    else:
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    qkv = clone.self_attention.layernorm_qkv
    assert qkv.joined_weight().data_ptr() == qkv.query_weight.data_ptr()
    clone.load_state_dict(make_layer("interleaved", seed=4).state_dict())
    x = torch.randn(5, 2, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(clone(x), make_layer("interleaved", seed=4)(x), atol=1e-12, rtol=0)
