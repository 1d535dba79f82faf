"""Wrong inputs to the modules and the GPT fail at the front door, in the caller's words: the
argument's name, the shape or values it got, and what the module was built for."""

import pytest
import torch
from fusedlayers.models import GPT, GPTConfig

from fusedlayers import MultiheadAttention, TransformerLayer


def _layer(fmt: str) -> TransformerLayer:
    return TransformerLayer(
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attn_input_format=fmt,
    )


@pytest.mark.parametrize(
    ("fmt", "shape", "match"),
    [
        # wrong width: named against hidden_size, not a weight's shape
        ("sbhd", (5, 2, 64), r"hidden_states has shape \(5, 2, 64\).*hidden_size \(32\)"),
        ("bshd", (2, 5, 64), r"hidden_states has shape \(2, 5, 64\).*hidden_size \(32\)"),
        ("thd", (7, 64), r"hidden_states has shape \(7, 64\).*hidden_size \(32\)"),
        # wrong rank: named against the layout attn_input_format declares
        ("sbhd", (10, 32), r"hidden_states has shape \(10, 32\).*attn_input_format='sbhd'"),
        ("bshd", (10, 32), r"\(10, 32\), but attn_input_format='bshd' takes \[b, s, hidden_size\]"),
        ("thd", (2, 5, 32), r"hidden_states has shape \(2, 5, 32\).*attn_input_format='thd'"),
        ("sbhd", (1, 5, 2, 32), r"hidden_states has shape \(1, 5, 2, 32\)"),
    ],
)
def test_transformer_layer_names_hidden_states(fmt, shape, match):
    layer = _layer(fmt)
    kwargs = {}
    if fmt == "thd":
        kwargs = dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32), max_seqlen_q=4)
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(shape), **kwargs)


def test_transformer_layer_rejects_integer_hidden_states():
    with pytest.raises(TypeError, match=r"hidden_states has dtype torch.int64"):
        _layer("sbhd")(torch.zeros(5, 2, 32, dtype=torch.long))


@pytest.mark.parametrize(
    ("fmt", "shape", "match"),
    [
        ("sbhd", (5, 2, 48), r"hidden_states has shape \(5, 2, 48\).*hidden_size \(32\)"),
        ("sbhd", (10, 32), r"hidden_states has shape \(10, 32\).*qkv_format='sbhd'"),
        ("thd", (2, 5, 32), r"hidden_states has shape \(2, 5, 32\).*qkv_format='thd'"),
    ],
)
def test_multihead_attention_names_hidden_states(fmt, shape, match):
    mha = MultiheadAttention(32, 4, attention_dropout=0.0, qkv_format=fmt)
    with pytest.raises(ValueError, match=match):
        mha(torch.randn(shape))


def test_cross_attention_names_encoder_output():
    mha = MultiheadAttention(32, 4, attention_dropout=0.0, attention_type="cross")
    with pytest.raises(ValueError, match=r"encoder_output has shape \(6, 2, 16\)"):
        mha(torch.randn(5, 2, 32), encoder_output=torch.randn(6, 2, 16), attn_mask_type="no_mask")


@pytest.fixture(scope="module")
def gpt():
    return GPT(GPTConfig.named("tiny", n_layer=1, d_model=32, n_head=2, context_length=16))


@pytest.mark.parametrize(
    ("idx", "error", "match"),
    [
        (torch.zeros(8, dtype=torch.long), ValueError, r"idx .*\[b, s\].*shape \(8,\)"),
        (torch.zeros(1, 2, 8, dtype=torch.long), ValueError, r"shape \(1, 2, 8\)"),
        (torch.zeros(2, 8), ValueError, r"idx .*shape \(2, 8\), dtype torch.float32"),
        (torch.zeros(2, 8, dtype=torch.uint8), ValueError, r"dtype torch.uint8"),
        (torch.zeros(2, 17, dtype=torch.long), ValueError, r"idx of shape \(2, 17\).*16"),
    ],
)
def test_gpt_forward_names_bad_idx(gpt, idx, error, match):
    with pytest.raises(error, match=match):
        gpt(idx)


@pytest.mark.parametrize(("bad", "low", "high"), [(256, 3, 256), (-1, -1, 5), (10**6, 3, 10**6)])
def test_gpt_forward_names_out_of_vocabulary_ids(gpt, bad, low, high):
    idx = torch.tensor([[3, 4, 5], [5, bad, 4]])
    pattern = rf"idx holds token ids in \[{low}, {high}\], outside \[0, vocab_size=256\)"
    with pytest.raises(ValueError, match=pattern):
        gpt(idx)
