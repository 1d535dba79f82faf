"""Decoding through the layers with lengths on the device (CPU; kernels under the interpreter).

`InferenceParams` keeps per-sequence lengths as a device tensor with a host mirror only while the
caller sets them from the host. `MultiheadAttention` decodes on the split-KV kernel (the
machinery of `flash_attn_with_kvcache`) when it takes its kernel path: cached steps must match
full recomputation in fp64 (tests/decode_testing.py), contiguous and paged, sbhd and bshd, MHA,
GQA and MQA, with per-sequence (ragged) lengths, and with lengths known only on the device. The
reference path handles ragged lengths too. Bad steps raise before any cache write.
"""

from __future__ import annotations

import os

import pytest
import torch
from decode_testing import check_decode, make_mha, rope_table, run_cached, run_full_high
from kvcache_testing import COMBINES, pin_combine, tickets_all_zero

import fusedlayers.attention.frontend as front_end
from fusedlayers.layers.inference import InferenceParams

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available()
    or os.environ.get("TRITON_INTERPRET") != "1"
    or front_end.flash_attention is None,
    reason="runs the decode kernel under the Triton CPU interpreter",
)
F16, F32 = torch.float16, torch.float32


def test_lengths_device_tensor_and_host_mirror():
    params = InferenceParams(3, 32)
    assert params.get_seqlens_pre_step() is params.pre_step_seqlens
    assert params.pre_step_seqlens.dtype == torch.int32
    params.sequence_len_offset += 5
    params.advance(2)
    assert params.sequence_len_offset == 7 and params.pre_step_seqlens.tolist() == [7, 7, 7]
    params.set_sequence_lengths([4, 9, 1])
    assert params.host_lengths(3) == [4, 9, 1]
    assert params.positions(2, 3).tolist() == [[4, 5, 6], [9, 10, 11]]
    with pytest.raises(ValueError, match=r"different lengths \[4, 9, 1\]"):
        _ = params.sequence_len_offset
    params.batch_size_offset = 1
    params.advance(torch.tensor([1, 2], dtype=torch.int32), batch_size=2)
    assert params.host_lengths(2) is None  # a device increment: the mirror is unknown now
    assert params.pre_step_seqlens.tolist() == [4, 10, 3]
    params.batch_size_offset = 0
    params.note_advanced(1)  # still unknown: nothing to update on the host
    params.set_sequence_lengths([2, 2, 2])
    params.swap_key_value_dict([2, 0, 1])
    params.reset()
    assert params.sequence_len_offset == 0 and params.pre_step_seqlens.tolist() == [0, 0, 0]


def test_device_read_when_the_mirror_is_unknown():
    params = InferenceParams(2, 16)
    params.advance(torch.tensor(3, dtype=torch.int32))
    assert params.host_lengths(2) is None
    assert params.sequence_len_offset == 3  # one read of the device lengths


PAGED = dict(max_batch_size=2, is_paged=True, page_size=16)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_batch_size=0, max_sequence_length=8), r"max_batch_size \(0\)"),
        (dict(max_batch_size=2, max_sequence_length=8.0), r"max_sequence_length \(8.0\)"),
        (dict(PAGED, max_sequence_length=64, page_size=24), "multiple of 16"),
        (dict(PAGED, max_sequence_length=40), r"max_sequence_length \(40\) must be a multiple"),
        (dict(PAGED, max_sequence_length=64, total_num_pages=7), r"\(7\) must be at least .* 8"),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InferenceParams(**kwargs)


def test_bad_lengths_and_allocation():
    params = InferenceParams(2, 16)
    with pytest.raises(ValueError, match=r"lengths has 3 entries, max_batch_size is 2"):
        params.set_sequence_lengths([1, 2, 3])
    with pytest.raises(ValueError, match=r"\[17\] are outside \[0, max_sequence_length = 16\]"):
        params.set_sequence_lengths([0, 17])
    with pytest.raises(ValueError, match="needs num_heads_kv, head_dim_k, dtype and device"):
        params.allocate_memory(1)
    params = InferenceParams(2, 16, num_heads_kv=2, head_dim_k=8, dtype=F32, device="cpu")
    params.allocate_memory(1)  # TE 2.x: geometry from the constructor
    assert params.key_value_memory_dict[1][0].shape == (2, 16, 2, 8)


STEPS = [7, 1, 3, 1]


@needs_interpreter
@pytest.mark.parametrize(
    "fmt,groups,paged,dtype",
    [
        ("bshd", 2, False, F16),
        ("sbhd", 4, False, F32),
        ("bshd", 1, True, F32),  # MQA, paged (shuffled pages)
        ("sbhd", 2, True, F16),
    ],
)
def test_decode_on_the_kernel_matches_full_recompute(kernels_on_cpu, fmt, groups, paged, dtype):
    check_decode(make_mha(groups, fmt, dtype, "cpu"), 2, STEPS, paged=paged, s_max=32)


@needs_interpreter
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("paged", [False, True])
def test_decode_steps_with_split_keys(kernels_on_cpu, monkeypatch, paged, combine):
    """A cache of 256 rows: the split heuristic gives the decode kernel two splits, merged in
    its own launch (fused) or a second one; either matches full recomputation."""
    merges = pin_combine(monkeypatch, combine)
    check_decode(make_mha(2, "bshd", F32, "cpu"), 2, STEPS, paged=paged, s_max=256)
    assert tickets_all_zero()
    assert (merges == []) == (combine == "fused")


@needs_interpreter
def test_decode_kernel_is_the_path_taken(kernels_on_cpu, monkeypatch):
    """On the kernel path core_attention (the training entry) is never called while decoding."""
    import fusedlayers.layers.cached_attention as cached

    mha = make_mha(2, "bshd", F32, "cpu")
    calls = []
    mha.core_attention.register_forward_pre_hook(lambda *a: calls.append("core"))
    original = cached.cache_attention

    def spy(*args, **kwargs):
        calls.append("decode")
        return original(*args, **kwargs)

    monkeypatch.setattr(cached, "cache_attention", spy)
    params = InferenceParams(1, 16)
    run_cached(mha, torch.randn(1, 4, 64), [3, 1], params, rope_table(16, 16, "cpu"))
    assert calls == ["decode", "decode"]


def _ragged_case(mha, lens, steps, s_max=32, seed=0):
    """Prompts of different lengths, right-padded into one batch, then decode steps: each
    sequence's outputs must equal running it alone through full recomputation."""
    g = torch.Generator().manual_seed(seed)
    b, width, dtype = len(lens), max(lens), mha.proj.weight.dtype
    seqs = [torch.randn(1, n + steps, 64, generator=g).to(dtype) for n in lens]
    prompt = torch.zeros(b, width, 64, dtype=dtype)
    for z, n in enumerate(lens):
        prompt[z, :n] = seqs[z][0, :n]
    table = rope_table(s_max, 16, "cpu")
    params = InferenceParams(b, s_max)
    with torch.no_grad():
        prompt_out = mha(prompt, inference_params=params, rotary_pos_emb=table)
        params.set_sequence_lengths(lens)  # padding rows past each length are overwritten later
        new = torch.cat([seqs[z][:, n : n + steps] for z, n in enumerate(lens)])
        out = run_cached(mha, new, [1] * steps, params, table)
    for z, n in enumerate(lens):
        want = run_full_high(mha, seqs[z], table)[0]
        torch.testing.assert_close(prompt_out[z, :n].double(), want[:n], atol=2e-5, rtol=0)
        torch.testing.assert_close(out[z].double(), want[n:], atol=2e-5, rtol=0)


@needs_interpreter
def test_ragged_lengths_on_the_kernel(kernels_on_cpu):
    _ragged_case(make_mha(2, "bshd", F32, "cpu"), [6, 3, 9], steps=3)


def test_ragged_lengths_on_the_reference():
    mha = make_mha(2, "bshd", F32, "cpu")
    mha.use_reference = True
    _ragged_case(mha, [6, 3, 9], steps=3)


@pytest.mark.parametrize("kernel", [True, False])
def test_lengths_known_only_on_the_device(request, kernel):
    """Lengths advanced by a device tensor (as inside a captured graph): same outputs."""
    if kernel:
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("runs the decode kernel under the Triton CPU interpreter")
        request.getfixturevalue("kernels_on_cpu")
    mha = make_mha(4, "sbhd", F32, "cpu")
    x, table = torch.randn(2, 6, 64), rope_table(16, 16, "cpu")
    mirrored = run_cached(mha, x, [4, 1, 1], InferenceParams(2, 16), table)
    params, outs = InferenceParams(2, 16), []
    with torch.no_grad():
        for start, n in ((0, 4), (4, 1), (5, 1)):
            outs.append(mha(x[:, start : start + n].transpose(0, 1), inference_params=params,
                            rotary_pos_emb=table).transpose(0, 1))  # fmt: skip
            params.advance(torch.tensor(n, dtype=torch.int32))
            assert params.host_lengths(2) is None
    torch.testing.assert_close(torch.cat(outs, 1), mirrored, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kernel", [True, False])
def test_bad_steps_raise_before_any_write(request, kernel):
    if kernel:
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("runs the decode kernel under the Triton CPU interpreter")
        request.getfixturevalue("kernels_on_cpu")
    mha = make_mha(2, "bshd", F32, "cpu")
    table = rope_table(8, 16, "cpu")
    params = InferenceParams(2, 16)
    with torch.no_grad():
        mha(torch.randn(2, 5, 64), inference_params=params, rotary_pos_emb=table)
    params.advance(5)
    before = [t.clone() for t in params.key_value_memory_dict[3]]
    cases = [
        (torch.randn(2, 12, 64), table, ValueError, r"KV cache overflow: tokens 5..17 of max"),
        (torch.randn(2, 4, 64), table, ValueError, r"RoPE table has 8 positions, but position 8"),
        (torch.randn(3, 1, 64), table, ValueError, r"batch rows 0..3 of max_batch_size 2"),
    ]
    for x, tab, error, match in cases:
        with pytest.raises(error, match=match), torch.no_grad():
            mha(x, inference_params=params, rotary_pos_emb=tab)
    params.set_sequence_lengths([5, 3])
    with pytest.raises(NotImplementedError, match="needs one cache length"), torch.no_grad():
        mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
        mha(torch.randn(2, 1, 64), attention_mask=mask, attn_mask_type="padding_causal",
            inference_params=params, rotary_pos_emb=table)  # fmt: skip
    for t, saved in zip(params.key_value_memory_dict[3], before):
        assert torch.equal(t, saved)
