"""Shared harness for decoding through `MultiheadAttention` with an `InferenceParams` cache (CPU
interpreter and GPU suites).

`check_decode` runs a prompt and then a few steps through the module with a KV cache (on the
decode kernel when the module takes its kernel path) and compares the concatenated outputs with
the same module recomputing the whole sequence without a cache, in fp64 on the reference path
("high"), under the pass rule of tests/attention_testing.py: the error is at most twice that of
the module run in the input dtype on its reference path with the cache ("low") plus an atol.
"""

from __future__ import annotations

import copy

import torch
from attention_testing import check_close

from fusedlayers.layers.inference import InferenceParams
from fusedlayers.layers.multihead_attention import MultiheadAttention
from fusedlayers.layers.rope import RotaryPositionEmbedding

HIDDEN, HEADS, HEAD_DIM = 64, 4, 16


def make_mha(groups, fmt, dtype, device, *, heads=HEADS, head_dim=HEAD_DIM, rope_interleaved=False):
    """A self-attention block with input LayerNorm and interleaved fused QKV (strided k/v views)."""
    torch.manual_seed(0)
    mha = MultiheadAttention(
        heads * head_dim,
        heads,
        kv_channels=head_dim,
        num_gqa_groups=groups,
        attention_dropout=0.0,
        layer_number=3,
        qkv_format=fmt,
        input_layernorm=True,
        fuse_qkv_params=True,
        rotary_pos_interleaved=rope_interleaved,
        params_dtype=torch.float32,
        device=device,
    ).eval()
    with torch.no_grad():  # weights of size ~1: scores then vary enough to test the softmax
        for p in mha.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.1)
    return mha.to(dtype)


def rope_table(n, head_dim, device, interleaved=False):
    return RotaryPositionEmbedding(head_dim, interleaved=interleaved, device=device)(n)


def _as_fmt(x_bsh, fmt):
    return x_bsh.transpose(0, 1) if fmt == "sbhd" else x_bsh


def run_cached(mha, x, steps, params, table) -> torch.Tensor:
    """x [b, s, hidden] fed in `steps` chunks through the cache -> outputs [b, s, hidden]."""
    fmt, outs, start = mha.qkv_format, [], 0
    with torch.no_grad():
        for n in steps:
            chunk = _as_fmt(x[:, start : start + n], fmt)
            outs.append(_as_fmt(mha(chunk, inference_params=params, rotary_pos_emb=table), fmt))
            params.advance(n)
            start += n
    return torch.cat(outs, dim=1)


def run_full_high(mha, x, table) -> torch.Tensor:
    """The whole sequence without a cache, fp64 on the reference path."""
    high = copy.deepcopy(mha).double()
    high.use_reference = True
    with torch.no_grad():
        out = high(_as_fmt(x.double(), mha.qkv_format), rotary_pos_emb=table.double())
    return _as_fmt(out, mha.qkv_format)


def make_params(b, s_max, paged, device, seed=0):
    if not paged:
        return InferenceParams(b, s_max, device=device)
    params = InferenceParams(b, s_max, is_paged=True, page_size=16, device=device)
    # Shuffle the pages, so that logical order differs from memory order.
    order = torch.randperm(params.total_num_pages, generator=torch.Generator().manual_seed(seed))
    params.block_table.copy_(order.view_as(params.block_table).to(torch.int32))
    return params


def check_decode(mha, b, steps, *, paged=False, s_max=64, seed=0) -> dict:
    """Cached decoding (kernel path when the module takes it) against fp64 full recompute."""
    device, dtype = mha.proj.weight.device, mha.proj.weight.dtype
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, sum(steps), mha.hidden_size, generator=g).to(device=device, dtype=dtype)
    table = rope_table(
        s_max, mha.hidden_size_per_attention_head, device, mha.rotary_pos_interleaved
    )
    out = run_cached(mha, x, steps, make_params(b, s_max, paged, device, seed), table)
    low_module = copy.deepcopy(mha)
    low_module.use_reference = True
    low = run_cached(low_module, x, steps, make_params(b, s_max, paged, device, seed), table)
    high = run_full_high(mha, x, table)
    return check_close("decode out", out, high, low, factor=2)
