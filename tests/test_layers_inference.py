"""KV-cache generation: prompt then decode steps through a stack of TransformerLayers equals
full recomputation over the whole sequence (MHA, GQA, MQA; sbhd and bshd; with RoPE), and a
decode step attends only its new queries over the cached prefix."""

from __future__ import annotations

import pytest
import torch

from fusedlayers.layers.inference import InferenceParams
from fusedlayers.layers.multihead_attention import MultiheadAttention
from fusedlayers.layers.rope import RotaryPositionEmbedding
from fusedlayers.layers.transformer_layer import TransformerLayer

HIDDEN, FFN, HEADS, HEAD_DIM = 32, 48, 4, 8
STEPS = [5, 1, 2, 1]  # prompt, then new tokens per step


def make_stack(fmt, groups, form):
    torch.manual_seed(0)
    fused, interleaved = {"separate": (False, True), "interleaved": (True, True)}[form]
    return [
        TransformerLayer(
            HIDDEN,
            FFN,
            HEADS,
            num_gqa_groups=groups,
            layer_number=n,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            attn_input_format=fmt,
            fuse_qkv_params=fused,
            qkv_weight_interleaved=interleaved,
            params_dtype=torch.float64,
        ).eval()
        for n in (1, 2)
    ]


def run(stack, x, **kwargs):
    for layer in stack:
        x = layer(x, **kwargs)
    return x


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("form", ["separate", "interleaved"])
def test_generation_matches_full_recompute(fmt, groups, form):
    stack = make_stack(fmt, groups, form)
    s_dim = 0 if fmt == "sbhd" else 1
    total, batch = sum(STEPS), 3
    shape = (total, batch, HIDDEN) if fmt == "sbhd" else (batch, total, HIDDEN)
    x = torch.randn(shape, dtype=torch.float64)
    table = RotaryPositionEmbedding(HEAD_DIM, rotary_percent=0.5)(16).double()
    with torch.no_grad():
        full = run(stack, x, rotary_pos_emb=table)
        params = InferenceParams(max_batch_size=batch, max_sequence_length=16)
        start = 0
        for n in STEPS:
            chunk = x.narrow(s_dim, start, n)
            out = run(stack, chunk, rotary_pos_emb=table, inference_params=params)
            want = full.narrow(s_dim, start, n)
            torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
            params.sequence_len_offset += n
            start += n


def test_decode_step_attends_new_queries_only():
    mha = MultiheadAttention(
        HIDDEN,
        HEADS,
        num_gqa_groups=1,
        attention_dropout=0.0,
        layer_number=1,
        qkv_format="sbhd",
        params_dtype=torch.float64,
    )
    seen = []

    def record(_module, args):
        q, k = args[:2]
        seen.append((q.shape[0], k.shape[0], k.untyped_storage().data_ptr()))

    mha.core_attention.register_forward_pre_hook(record)
    params = InferenceParams(max_batch_size=2, max_sequence_length=64)
    with torch.no_grad():
        mha(torch.randn(40, 2, HIDDEN, dtype=torch.float64), inference_params=params)
        params.sequence_len_offset = 40
        mha(torch.randn(1, 2, HIDDEN, dtype=torch.float64), inference_params=params)
    key_cache, _ = params.key_value_memory_dict[1]
    assert key_cache.shape == (64, 2, 1, HEAD_DIM)
    # 1 query over 41 cached keys, read in place from the cache (no copy).
    cache = key_cache.untyped_storage().data_ptr()
    assert seen == [(40, 40, cache), (1, 41, cache)]


def test_batch_offset_and_swap():
    """Micro-batched decoding writes its own cache rows; swap reorders batch rows (beams)."""
    torch.manual_seed(1)
    mha = MultiheadAttention(
        HIDDEN,
        HEADS,
        num_gqa_groups=2,
        attention_dropout=0.0,
        qkv_format="bshd",
        params_dtype=torch.float64,
    )
    x = torch.randn(4, 3, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        whole = mha(x)
        params = InferenceParams(max_batch_size=4, max_sequence_length=8)
        for rows in (slice(0, 2), slice(2, 4)):
            params.batch_size_offset = rows.start
            torch.testing.assert_close(mha(x[rows], inference_params=params), whole[rows])
        key_cache, _ = params.key_value_memory_dict[1]
        before = key_cache.clone()
        params.swap_key_value_dict([3, 2, 1, 0])
        assert torch.equal(params.key_value_memory_dict[1][0], before.flip(0))


def test_cache_overflow_and_thd_are_refused():
    params = InferenceParams(max_batch_size=1, max_sequence_length=4)
    mha = MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, params_dtype=torch.float64)
    with pytest.raises(ValueError, match="overflow"):
        mha(torch.randn(5, 1, HIDDEN, dtype=torch.float64), inference_params=params)
    thd = MultiheadAttention(
        HIDDEN, HEADS, attention_dropout=0.0, qkv_format="thd", params_dtype=torch.float64
    )
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="sbhd and bshd"):
        thd(
            torch.randn(3, HIDDEN, dtype=torch.float64),
            inference_params=params,
            cu_seqlens_q=cu,
            max_seqlen_q=3,
        )
