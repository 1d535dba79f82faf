"""Regression tests for the bugs the randomized differential test (tests/random_cases.py) found,
one each, in the shapes it found them."""

import pytest
import torch
from attention_testing import Case, check_case, check_close
from fusedlayers.kernels._flash_bwd import bwd_config, fit_shared_memory, pass_shared_memory
from kvcache_testing import KVCase, call_kernel, make_kv_inputs, reference

from fusedlayers import flash_attn_with_kvcache

F32, F16 = torch.float32, torch.float16


@pytest.mark.parametrize(
    "case",
    [
        Case(dtype=F32, softcap=30.0, s_q=11, s_k=19),
        Case(dtype=F16, softcap=50.0, s_q=7, s_k=9, window=(-1, 0)),
        Case(dtype=F32, softcap=30.0, layout="varlen", b=2, s_q=9, s_k=13),
    ],
    ids=lambda c: c.label(),
)
def test_large_softcap_is_accurate(case, device):
    """A large softcap puts the scaled scores near 0, where tanh as 1 - 2 / (e^{2x} + 1) cancels:
    fp32 outputs and LSE read 4-30x PyTorch's error. Forward and gradients by the 2x rule."""
    check_case(case, device)


@pytest.mark.parametrize("page_size", [None, 16])
def test_rotary_tables_must_cover_the_queries(page_size):
    """Causal with rotary rotates query i at cache_seqlens + i: with s_q > s_new the queries
    reach past the new keys, and a table that covered only the keys was read past its end."""
    case = KVCase(b=2, s_q=4, s_new=1, s_cache=64, causal=True, rotary="interleaved", seed=5,
                  page_size=page_size)  # fmt: skip
    inputs = make_kv_inputs(case, "cpu")
    inputs["lens"] = [20, 13]  # well inside the 64-position tables
    inputs["cache_seqlens"] = torch.tensor(inputs["lens"], dtype=torch.int32)
    call = dict(
        cache_seqlens=inputs["cache_seqlens"], causal=True, block_table=inputs["block_table"]
    )
    cos, sin = (t[:21] for t in (inputs["rotary_cos"], inputs["rotary_sin"]))  # keys only
    with pytest.raises(ValueError, match="21 positions, but position 23 is needed"):
        flash_attn_with_kvcache(
            inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["k"], inputs["v"],
            rotary_cos=cos, rotary_sin=sin, **call,
        )  # fmt: skip
    out, _ = call_kernel(case, inputs)  # the whole tables: correct
    high, _ = reference(case, inputs, torch.float64)
    low, _ = reference(case, inputs, case.dtype)
    check_close("out", out, high, low, factor=2.0)


PASSES = (("BLOCK_N1", "BLOCK_M1", "STAGES1"), ("BLOCK_M2", "BLOCK_N2", "STAGES2"))


@pytest.mark.parametrize("head_dim", [72, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_backward_tiles_fit_shared_memory(head_dim, causal):
    """fp32 inputs from d = 72 on asked 288 KiB of shared memory of an H200's 227 (the tables
    are tuned for 16-bit inputs): their tiles shrink to fit, 16-bit tiles stay as tuned."""
    limit = 227 * 1024
    cfg = bwd_config(head_dim, True, 4096, causal, elem_size=4, smem_bytes=limit)
    pow2 = 1 << (head_dim - 1).bit_length()
    for resident, streamed, stages in PASSES:
        assert 2 * pow2 * 4 * (cfg[resident] + cfg[stages] * cfg[streamed]) <= limit, cfg
        assert cfg[resident] >= 16 and cfg[streamed] >= 16 and cfg[stages] >= 1
    assert bwd_config(head_dim, True, 4096, causal, elem_size=2, smem_bytes=limit) == bwd_config(
        head_dim, True, 4096, causal
    )
    assert fit_shared_memory(cfg, pow2, 4, limit) == cfg  # a fitting config stays as it is


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("elem_size, bias_elem_size", [(2, 2), (2, 4), (4, 4)])
@pytest.mark.parametrize("max_len", [97, 4096])
def test_backward_tiles_with_a_bias_fit_shared_memory(head_dim, elem_size, bias_elem_size,
                                                      max_len):  # fmt: skip
    """A bias adds one [rows, rows] score tile per pipeline stage to each backward pass: bf16 at
    d = 80 and 96 with an fp32 bias (or a mask with a bias) asked 256 KiB of an H200's 227 in the
    dQ pass (OutOfResources). Both passes now fit; without a bias the tuned tiles stay."""
    limit = 227 * 1024
    pow2 = 1 << (head_dim - 1).bit_length()
    for causal in (False, True):
        cfg = bwd_config(head_dim, True, max_len, causal, elem_size=elem_size, smem_bytes=limit,
                         bias_elem_size=bias_elem_size)  # fmt: skip
        for tiles in PASSES:
            assert pass_shared_memory(cfg, tiles, pow2, elem_size, bias_elem_size) <= limit, cfg
            assert min(cfg[name] for name in tiles[:2]) >= 16 and cfg[tiles[2]] >= 1
    tuned = bwd_config(head_dim, True, max_len, False)
    # The case the random test found: the tuned dQ tiles at d = 96 with an fp32 bias overflow.
    if head_dim == 96 and (elem_size, bias_elem_size) == (2, 4):
        assert pass_shared_memory(tuned, PASSES[1], pow2, 2, 4) > limit
        assert bwd_config(head_dim, True, max_len, False, smem_bytes=limit,
                          bias_elem_size=4) != tuned  # fmt: skip
    assert bwd_config(head_dim, True, max_len, False, smem_bytes=limit) == tuned
