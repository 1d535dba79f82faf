"""Packed q/k/v on the H100 kernels, bf16: the packed gradient is one buffer, written in place.

q/k/v are `split_packed` views of one `[s, b, 3, h, d]` (DotProductAttention, sbhd) or
`[b, s, 3, h, d]` / `[t, 3, h, d]` (the packed flash-attn functions) buffer. With
`deterministic=True` the packed gradient must equal, bit for bit, the gradients of contiguous
copies, and the backward must build it without a copy: it is stored in the buffer the kernels
wrote, and no cat/stack/select-backward/copy of the packed size runs. Timing lives in
`examples/benchmark_attention.py --cases packed`, not here.
"""

from __future__ import annotations

import pytest
import torch
from fusedlayers.kernels import attention_ops
from torch.utils._python_dispatch import TorchDispatchMode

from fusedlayers import (
    DotProductAttention,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_qkvpacked_func,
    split_packed,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
B, S, H, D = 2, 1024, 8, 128
# Ops that would (re)build the packed gradient from separate pieces.
COPYING_OPS = {"cat", "stack", "select_backward", "slice_backward", "add", "copy_", "clone"}


class _PackedSizeOps(TorchDispatchMode):
    """Names of the aten ops that produce a tensor with `numel` elements (the packed size)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.names = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        if any(isinstance(t, torch.Tensor) and t.numel() == self.numel for t in outputs):
            self.names.append(func.overloadpacket.__name__)
        return result


@pytest.fixture
def written(monkeypatch):
    """(dq, dk, dv) as the kernels wrote them, per backward launch."""
    launches, backward = [], attention_ops.flash_attention_backward

    def record(*args, **kwargs):
        result = backward(*args, **kwargs)
        launches.append(result[:3])
        return result

    monkeypatch.setattr(attention_ops, "flash_attention_backward", record)
    return launches


def _backward_in_place(out, dout, packed, written) -> None:
    """Run the backward; assert the packed gradient is the kernels' buffer, built uncopied."""
    with _PackedSizeOps(packed.numel()) as seen:
        out.backward(dout)
    assert not COPYING_OPS & set(seen.names), seen.names
    (grads,) = written
    storage = packed.grad.untyped_storage().data_ptr()
    assert all(g.untyped_storage().data_ptr() == storage for g in grads)


def _packed_leaf(shape) -> torch.Tensor:
    return torch.randn(shape, device=DEVICE, dtype=torch.bfloat16).requires_grad_()


def _copies(tensors) -> list[torch.Tensor]:
    return [t.detach().contiguous().requires_grad_() for t in tensors]


@pytest.mark.parametrize("causal", [False, True])
def test_dpa_sb3hd_gradient_is_one_buffer(written, causal):
    buf = _packed_leaf((S, B, 3, H, D))
    attn = DotProductAttention(
        H, D, qkv_format="sbhd", attn_mask_type="causal" if causal else "no_mask"
    )
    attn.deterministic = True
    out = attn(*split_packed(buf, 2))
    dout = torch.randn_like(out)
    _backward_in_place(out, dout, buf, written)
    pieces = _copies(buf.unbind(2))
    expected = attn(*pieces)
    expected.backward(dout)
    assert torch.equal(out, expected)
    assert torch.equal(buf.grad, torch.stack([p.grad for p in pieces], 2))


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_bs3hd_gradient_is_one_buffer(written, causal):
    qkv = _packed_leaf((B, S, 3, H, D))
    out = flash_attn_qkvpacked_func(qkv, causal=causal, deterministic=True)
    dout = torch.randn_like(out)
    _backward_in_place(out, dout, qkv, written)
    pieces = _copies(qkv.unbind(2))
    flash_attn_func(*pieces, causal=causal, deterministic=True).backward(dout)
    assert torch.equal(qkv.grad, torch.stack([p.grad for p in pieces], 2))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_t3hd_gradient_is_one_buffer(written, causal):
    lengths = [S, S // 2, S // 2 - 37, 37]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(DEVICE)
    qkv = _packed_leaf((sum(lengths), 3, H, D))
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, S, causal=causal, deterministic=True)
    dout = torch.randn_like(out)
    _backward_in_place(out, dout, qkv, written)
    pieces = _copies(qkv.unbind(1))
    flash_attn_varlen_func(*pieces, cu, cu, S, S, causal=causal, deterministic=True).backward(dout)
    assert torch.equal(qkv.grad, torch.stack([p.grad for p in pieces], 1))
