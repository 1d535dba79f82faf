"""Every TE layout and the issue-1195 head-split views through `DotProductAttention` on the
Triton kernels, bf16 on CUDA: the views must give what contiguous copies give (the kernels read
them in place through their strides) and what the reference path gives.

The layouts are built by `tests/test_layouts.py`'s builders (TE's way: one buffer per chunk of
the layout name, split along its packed dim), here with bf16 CUDA buffers.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_layouts import TE_LAYOUTS, _cu_seqlens, _lengths, build, issue_1195_views

from fusedlayers import DotProductAttention
from fusedlayers.attention.layouts import QKV_LAYOUTS, get_qkv_layout

DEVICE = "cuda"
HEADS = {"mha": (16, 16), "gqa": (16, 4), "mqa": (16, 1)}
# (b, s_q, s_kv, d): a round self-attention shape and an odd cross-attention one.
SHAPES = ((2, 128, 128, 64), (3, 97, 161, 128))
TOL = dict(atol=1e-2, rtol=1e-2)  # bf16 rounding of outputs that differ only in how they are read


def _randn(shape) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)


def _forward_backward(module, q, k, v, fmt, lengths, d_out):
    """Output and (dq, dk, dv) of one call; thd sequences get their cu_seqlens."""
    kw = {}
    if fmt == "thd":
        kw = dict(
            cu_seqlens_q=_cu_seqlens(lengths[0]).to(DEVICE),
            cu_seqlens_kv=_cu_seqlens(lengths[1]).to(DEVICE),
            max_seqlen_q=max(lengths[0]),
            max_seqlen_kv=max(lengths[1]),
        )
    out = module(q, k, v, **kw)
    return out, torch.autograd.grad(out, (q, k, v), d_out)


def _check_in_place(q, k, v, fmt, h, hg, d, lengths):
    """Views vs contiguous copies on the kernels, and vs the reference path: outputs and grads.

    Gradients are taken with respect to the views themselves, so a kernel that wrote dq/dk/dv
    through wrong strides would show up as well as one that read q/k/v through wrong ones.
    """
    dpa = DotProductAttention(
        num_attention_heads=h,
        kv_channels=d,
        num_gqa_groups=hg,
        qkv_format=fmt,
        attn_mask_type="causal",
    )
    copies = [t.contiguous() for t in (q, k, v)]
    d_out = torch.randn(*q.shape[:-2], h * d, device=DEVICE, dtype=q.dtype)
    out, grads = _forward_backward(dpa, q, k, v, fmt, lengths, d_out)
    want, want_grads = _forward_backward(dpa, *copies, fmt, lengths, d_out)
    dpa.use_reference = True
    ref, ref_grads = _forward_backward(dpa, q, k, v, fmt, lengths, d_out)
    assert out.abs().max() > 0 and torch.isfinite(out).all()
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(out, ref, **TOL)
    for name, got, copied, reference in zip("qkv", grads, want_grads, ref_grads):
        torch.testing.assert_close(got, copied, **TOL, msg=lambda m, n=name: f"d{n}: {m}")
        scale = reference.abs().max().item()
        torch.testing.assert_close(
            got,
            reference,
            atol=2e-2 * max(scale, 1.0),
            rtol=2e-2,
            msg=lambda m, n=name: f"d{n} vs reference: {m}",
        )


def _layout_cases():
    for fmt, heads, shape in itertools.product(TE_LAYOUTS, HEADS, SHAPES):
        h, hg = HEADS[heads]
        b, s_q, s_kv, d = shape
        for name in TE_LAYOUTS[fmt]:
            if "3" in name and (h != hg or s_q != s_kv):
                continue  # one [.., 3, h, d] buffer holds q, k and v: same heads and lengths
            yield pytest.param(name, fmt, heads, shape, id=f"{name}-{heads}-b{b}s{s_q}x{s_kv}d{d}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout, fmt, heads, shape", list(_layout_cases()))
def test_every_te_layout_on_the_kernels(layout, fmt, heads, shape):
    b, s_q, s_kv, d = shape
    h, hg = HEADS[heads]
    q, k, v = build(layout, b, s_q, s_kv, h, hg, d, alloc=_randn)
    assert get_qkv_layout(q, k, v, fmt) == layout
    _check_in_place(q, k, v, fmt, h, hg, d, _lengths(b, s_q, s_kv))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", TE_LAYOUTS)
@pytest.mark.parametrize("hg", (1, 4))
@pytest.mark.parametrize("grouped", (False, True), ids=("split", "grouped"))
def test_issue_1195_head_split_views_on_the_kernels(fmt, hg, grouped):
    b, s, h, d = 2, 256, 16, 64
    q, k, v = issue_1195_views(fmt, b, s, h, hg, d, grouped, alloc=_randn)
    assert get_qkv_layout(q, k, v, fmt) not in QKV_LAYOUTS
    _check_in_place(q, k, v, fmt, h, hg, d, ((s,) * b,) * 2)
