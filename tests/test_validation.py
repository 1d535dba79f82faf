"""Every bad input raises before compute, naming the argument and its value."""

import pytest
import torch
from fusedlayers.kernels import _compat

import fusedlayers
from fusedlayers import DotProductAttention
from fusedlayers.attention.frontend import attention

H, D = 4, 8


def _dpa(**kwargs):
    return DotProductAttention(H, D, **{"qkv_format": "bshd", **kwargs})


def _qkv(b=2, s=5, h=H, hg=H, d=D, dtype=torch.float32):
    return (
        torch.randn(b, s, h, d, dtype=dtype),
        torch.randn(b, s, hg, d, dtype=dtype),
        torch.randn(b, s, hg, d, dtype=dtype),
    )


def test_wrong_rank_for_format():
    q, k, v = _qkv()
    with pytest.raises(
        ValueError, match=r"query_layer must be 4-D for qkv_format='bshd'.*\(2, 5, 32\)"
    ):
        _dpa()(q.flatten(2), k, v)
    with pytest.raises(ValueError, match="must be 3-D for qkv_format='thd'"):
        _dpa(qkv_format="thd")(q, k, v)


def test_dtype_and_device_mismatch_and_unsupported_dtype():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="key_layer dtype torch.float16 differs"):
        _dpa()(q, k.half(), v)
    with pytest.raises(TypeError, match="query_layer dtype torch.int64 is not supported"):
        _dpa()(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="value_layer is on meta but query_layer is on cpu"):
        _dpa()(q, k, v.to("meta"))


def test_head_dim_over_256_on_the_kernel_path():
    q, k, v = (torch.randn(1, 4, 1, 264) for _ in range(3))
    with pytest.raises(ValueError, match="head dim 264 exceeds the kernels' maximum 256"):
        fusedlayers.flash_attn_func(q, k, v)


def test_head_dim_and_shape_mismatches():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"query_layer head dim \(8\) differs from key_layer"):
        attention(q, k[..., :6], v[..., :6], backend="reference")
    with pytest.raises(
        ValueError, match=r"key_layer \(2, 5, 4, 8\) and value_layer \(2, 6, 4, 8\)"
    ):
        _dpa()(q, k, torch.randn(2, 6, H, D))
    with pytest.raises(ValueError, match="query_layer heads is 3, but the module was built for 4"):
        _dpa()(*_qkv(h=3, hg=3))


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(
        ValueError,
        match=r"query heads \(4\) must be a positive multiple of the number of KV heads \(3\)",
    ):
        DotProductAttention(4, D, num_gqa_groups=3)
    with pytest.raises(ValueError, match=r"query heads \(4\).*KV heads \(3\)"):
        attention(*_qkv(hg=3), backend="reference")


@pytest.mark.parametrize(
    "cu,match",
    [
        (torch.tensor([0, 3, 10], dtype=torch.int64), "must be a 1-D int32 tensor"),
        (torch.tensor([[0, 3, 10]], dtype=torch.int32), "must be a 1-D int32 tensor"),
        (torch.tensor([1, 3, 10], dtype=torch.int32), "must start at 0"),
        (torch.tensor([0, 6, 4, 10], dtype=torch.int32), "must not decrease"),
        (torch.tensor([0, 3, 9], dtype=torch.int32), "ends at 9 but the tensor holds 10 tokens"),
    ],
)
def test_bad_cu_seqlens(cu, match):
    q, k, v = (t[0] for t in _qkv(b=1, s=10))
    with pytest.raises((ValueError, TypeError), match=f"cu_seqlens_q.*{match}|{match}"):
        _dpa(qkv_format="thd")(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)


def test_cu_seqlens_batch_mismatch_and_max_seqlen():
    q, k, v = (t[0] for t in _qkv(b=1, s=10))
    cu2 = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu3 = torch.tensor([0, 4, 7, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q has 2 sequences but cu_seqlens_kv has 3"):
        _dpa(qkv_format="thd")(q, k, v, cu_seqlens_q=cu2, cu_seqlens_kv=cu3)
    with pytest.raises(ValueError, match=r"max_seqlen_q=5 is below the longest sequence \(6\)"):
        _dpa(qkv_format="thd")(q, k, v, cu_seqlens_q=cu2, cu_seqlens_kv=cu2, max_seqlen_q=5)


def test_cu_seqlens_read_once_per_version_and_rechecked_after_an_in_place_edit(monkeypatch):
    """Host values are cached per tensor (a CUDA read stalls the host), never past an edit."""
    q, k, v = (t[0] for t in _qkv(b=1, s=10))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or original(t))
    dpa = _dpa(qkv_format="thd")
    first = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert sum(r is cu for r in reads) == 1
    cu[1] = 6  # same tensor, new lengths: must be read and used again
    second = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert sum(r is cu for r in reads) == 2
    assert not torch.allclose(first[:6], second[:6])
    cu[1] = 11
    with pytest.raises(ValueError, match="must not decrease"):
        dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)


def test_cu_seqlens_made_in_inference_mode_are_read_every_call():
    """Inference tensors have no version counter: nothing about them may be remembered, and
    an in-place edit of the lengths must still change the result."""
    q, k, v = (t[0] for t in _qkv(b=1, s=10))
    dpa = _dpa(qkv_format="thd")
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        first = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        cu[1] = 6
        second = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        expected = dpa(q, k, v, cu_seqlens_q=cu.clone(), cu_seqlens_kv=cu.clone())
    assert not torch.allclose(first[:6], second[:6])
    torch.testing.assert_close(second, expected, rtol=0, atol=0)


def test_padding_mask_read_once_per_version_and_rechecked_after_an_in_place_edit(monkeypatch):
    """A padding mask's right-padding check (a host read) runs once per mask version."""
    q, k, v = _qkv(b=2, s=6)
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., 4:] = True
    reads = []
    original = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: reads.append(1) or original(a, b))
    dpa = _dpa(attn_mask_type="padding")
    first = dpa(q, k, v, attention_mask=mask)
    dpa(q, k, v, attention_mask=mask)
    assert len(reads) == 1
    mask[1, ..., 2:] = True  # same tensor, shorter second sequence: read and used again
    second = dpa(q, k, v, attention_mask=mask)
    assert len(reads) == 2
    assert original(first[0], second[0]) and not torch.allclose(first[1], second[1])


def test_padded_offsets_too_small_for_a_sequence():
    q, k, v = (t[0] for t in _qkv(b=1, s=10))
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    padded = torch.tensor([0, 3, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="sequence 0 has 4 tokens .* only 3 rows"):
        _dpa(qkv_format="thd")(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded,
        )


def test_dropout_range():
    with pytest.raises(ValueError, match=r"attention_dropout=1.0 must be in \[0, 1\)"):
        DotProductAttention(H, D, attention_dropout=1.0)
    with pytest.raises(ValueError, match=r"dropout_p=-0.1"):  # flash-attn's name for it
        fusedlayers.flash_attn_func(*_qkv(), dropout_p=-0.1)


def test_mask_and_bias_not_broadcastable():
    q, k, v = _qkv()
    with pytest.raises(
        ValueError, match=r"attention_mask with shape \(2, 1, 5, 4\) does not broadcast"
    ):
        _dpa(attn_mask_type="arbitrary")(
            q, k, v, attention_mask=torch.zeros(2, 1, 5, 4, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match=r"core_attention_bias with shape \(3, 4, 5, 5\)"):
        _dpa()(
            q,
            k,
            v,
            core_attention_bias_type="post_scale_bias",
            core_attention_bias=torch.zeros(3, H, 5, 5),
        )
    with pytest.raises(ValueError, match="attention_mask is given but attn_mask_type='causal'"):
        _dpa()(q, k, v, attention_mask=torch.zeros(2, 1, 1, 5, dtype=torch.bool))


def test_unknown_format_mask_type_and_bias_type():
    with pytest.raises(ValueError, match="qkv_format='hbsd' is not one of"):
        DotProductAttention(H, D, qkv_format="hbsd")
    with pytest.raises(ValueError, match="attn_mask_type='causal_top_left' is not one of"):
        DotProductAttention(H, D, attn_mask_type="causal_top_left")
    with pytest.raises(ValueError, match="core_attention_bias_type='relative'"):
        _dpa()(*_qkv(), core_attention_bias_type="relative")
    with pytest.raises(ValueError, match="alibi_slopes shape"):
        _dpa()(*_qkv(), core_attention_bias_type="alibi", alibi_slopes=torch.ones(3))


def test_functional_api_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    """Kernels defined for a GPU (the interpreter off at import) refuse CPU tensors."""
    monkeypatch.setattr(_compat, "INTERPRETER", False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need CUDA tensors, got q on cpu"):
        fusedlayers.flash_attn_func(*_qkv())


def test_packed_functional_shapes_are_checked():
    with pytest.raises(ValueError, match=r"qkv must be 5-D \[b, s, 3, h, d\]"):
        fusedlayers.flash_attn_qkvpacked_func(torch.randn(2, 5, 3, 8))
    with pytest.raises(ValueError, match="kv must have size 2 in dim 2"):
        fusedlayers.flash_attn_kvpacked_func(torch.randn(2, 5, H, D), torch.randn(2, 5, 3, H, D))
