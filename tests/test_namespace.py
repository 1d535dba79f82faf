"""`import fusedlayers as te` stands in for `import transformer_engine.pytorch as te`: TE's module
names resolve at the top level, next to flash-attn's functions, and `__all__` lists exactly them."""

from __future__ import annotations

import types

import pytest

import fusedlayers as te
from fusedlayers import fp8
from fusedlayers.attention import layouts
from fusedlayers.layers import (
    inference,
    linear,
    mlp,
    multihead_attention,
    normalization,
    rope,
    transformer_layer,
)

TRANSFORMER_ENGINE_NAMES = {
    "TransformerLayer": transformer_layer.TransformerLayer,
    "MultiheadAttention": multihead_attention.MultiheadAttention,
    "Linear": linear.Linear,
    "LayerNormLinear": linear.LayerNormLinear,
    "LayerNormMLP": mlp.LayerNormMLP,
    "LayerNorm": normalization.LayerNorm,
    "RMSNorm": normalization.RMSNorm,
    "RotaryPositionEmbedding": rope.RotaryPositionEmbedding,
    "apply_rotary_pos_emb": rope.apply_rotary_pos_emb,
    "InferenceParams": inference.InferenceParams,
    "get_qkv_layout": layouts.get_qkv_layout,
    "fp8_autocast": fp8.fp8_autocast,
    "autocast": fp8.autocast,
    "fp8_model_init": fp8.fp8_model_init,
    "quantized_model_init": fp8.quantized_model_init,
    "is_fp8_available": fp8.is_fp8_available,
}
FLASH_ATTN_NAMES = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


@pytest.mark.parametrize("name", sorted(TRANSFORMER_ENGINE_NAMES))
def test_transformer_engine_name_at_top_level(name):
    assert getattr(te, name) is TRANSFORMER_ENGINE_NAMES[name]
    assert name in te.__all__


def test_all_lists_exactly_the_public_names():
    public = {
        name
        for name, value in vars(te).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert len(te.__all__) == len(set(te.__all__)), "__all__ repeats a name"
    assert set(te.__all__) == public
    assert {*TRANSFORMER_ENGINE_NAMES, *FLASH_ATTN_NAMES, "DotProductAttention"} <= public


def test_recipe_module_at_top_level():
    """TE's `transformer_engine.common.recipe` is `fusedlayers.recipe`."""
    import fusedlayers.recipe

    assert te.recipe is fusedlayers.recipe
    assert te.recipe.DelayedScaling().fp8_format is te.recipe.Format.HYBRID


def test_star_import_gives_the_layers():
    namespace: dict = {}
    exec("from fusedlayers import *", namespace)
    assert namespace["TransformerLayer"] is transformer_layer.TransformerLayer
    assert namespace["get_qkv_layout"] is layouts.get_qkv_layout
