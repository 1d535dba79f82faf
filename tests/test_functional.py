"""The flash-attn functional API: every variant against the reference, forward and backward.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
so shapes stay tiny and dtypes are fp32/fp16; on CUDA the same tests run the compiled kernels.
"""

import pytest
import torch

import fusedlayers as fl
from fusedlayers.attention.reference import attention_reference

B, S_Q, S_K, H, HG, D = 2, 9, 13, 4, 2, 16


def _tensors(*shapes, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
        for s in shapes
    ]


def _grads(out, inputs, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return torch.autograd.grad(out, inputs, dout)


def _close(got, want, dtype):
    tol = {torch.float32: 2e-3, torch.float16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2))])
def test_flash_attn_func_matches_reference(device, dtype, causal, window):
    q, k, v = _tensors((B, S_Q, H, D), (B, S_K, HG, D), (B, S_K, HG, D), dtype=dtype, device=device)
    out, lse, _ = fl.flash_attn_func(
        q, k, v, causal=causal, window_size=window, return_attn_probs=True
    )
    eff = (window[0], 0) if causal else window
    ref, ref_lse = attention_reference(q, k, v, window_size=eff, bottom_right=True, return_lse=True)
    _close(out, ref, dtype)
    _close(lse, ref_lse, torch.float32)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        _close(got, want, dtype)


def test_qkvpacked_and_kvpacked_read_views_and_return_packed_grads(device):
    dtype = torch.float32
    (qkv,) = _tensors((B, S_Q, 3, H, D), dtype=dtype, device=device)
    out = fl.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.unbind(2)
    ref = attention_reference(q, k, v, window_size=(-1, 0))
    _close(out, ref, dtype)
    (g_out,) = _grads(out, (qkv,))
    (g_ref,) = _grads(ref, (qkv,))
    _close(g_out, g_ref, dtype)

    q, kv = _tensors((B, S_Q, H, D), (B, S_K, 2, HG, D), dtype=dtype, device=device)
    out = fl.flash_attn_kvpacked_func(q, kv, causal=True, softcap=5.0)
    ref = attention_reference(q, *kv.unbind(2), window_size=(-1, 0), softcap=5.0)
    _close(out, ref, dtype)
    for got, want in zip(_grads(out, (q, kv)), _grads(ref, (q, kv))):
        _close(got, want, dtype)


def test_varlen_variants(device):
    dtype = torch.float16
    cu_q = torch.tensor([0, 4, 11], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 6, 9], dtype=torch.int32, device=device)
    q, k, v = _tensors((11, H, D), (9, HG, D), (9, HG, D), dtype=dtype, device=device)
    out = fl.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, causal=True)
    ref = attention_reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, window_size=(-1, 0))
    _close(out, ref, dtype)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        _close(got, want, dtype)

    (qkv,) = _tensors((11, 3, H, D), dtype=dtype, device=device)
    out = fl.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 7)
    ref = attention_reference(*qkv.unbind(1), cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q)
    _close(out, ref, dtype)

    q, kv = _tensors((11, H, D), (9, 2, HG, D), dtype=dtype, device=device)
    out = fl.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 7, 6, window_size=(2, 1))
    ref = attention_reference(
        q, *kv.unbind(1), cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, window_size=(2, 1)
    )
    _close(out, ref, dtype)


def test_alibi_and_scale(device):
    dtype = torch.float32
    q, k, v = _tensors((B, S_Q, H, D), (B, S_K, H, D), (B, S_K, H, D), dtype=dtype, device=device)
    slopes = torch.rand(B, H, device=device)
    out = fl.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, softmax_scale=0.3)
    ref = attention_reference(q, k, v, window_size=(-1, 0), alibi_slopes=slopes, softmax_scale=0.3)
    _close(out, ref, dtype)


def test_dot_product_attention_kernel_path_through_the_interpreter(device):
    """The module on the kernel backend equals its reference path (arbitrary mask included,
    which reaches the kernels as a -inf bias with fully masked rows)."""
    from fusedlayers.attention.frontend import attention

    dtype = torch.float32
    q, k, v = _tensors((S_Q, B, H, D), (S_Q, B, HG, D), (S_Q, B, HG, D), dtype=dtype, device=device)
    mask = torch.rand(B, 1, S_Q, S_Q, generator=torch.Generator().manual_seed(2)) < 0.3
    mask[:, :, 0] = True
    mask = mask.to(device)
    kw = dict(qkv_format="sbhd", attn_mask_type="arbitrary", attention_mask=mask)
    out, _ = attention(q, k, v, backend="kernel", **kw)
    ref, _ = attention(q, k, v, backend="reference", **kw)
    _close(out, ref, dtype)
    assert out[0].abs().max() == 0
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert torch.isfinite(got).all()
        _close(got, want, dtype)
