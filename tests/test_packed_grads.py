"""Packed q/k/v get their gradient as one buffer, uncopied, with exact values and autograd.

q/k/v taken from one packed tensor with `split_packed` (directly, through the packed flash-attn
functions or MultiheadAttention's projection split) reach the kernels as views; the eager
backward writes their gradients into views of one buffer laid out like the packed tensor, and
`split_packed` hands that buffer back as the packed gradient. Checked here, under the Triton
interpreter in fp32/fp16 on tiny shapes:

- values: the packed gradient equals, bit for bit (`deterministic=True`), the gradients of
  contiguous copies of the same q/k/v;
- no copy: the packed leaf's `.grad` is stored in the very buffer the kernels wrote (a cat,
  stack or select-backward copy would put it in a new one);
- every element written: the planned buffers are poisoned with NaN before the kernels run, so an
  unwritten element (a tiling mistake, padding rows left unzeroed) shows up;
- views that do not tile their buffer, and gradients that went through a copy, take the old,
  always-correct path; `torch.autograd.grad` / `retain_grad` on a piece still work.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from fusedlayers.kernels import attention_ops
from fusedlayers.kernels._packed import plan_packed_grads, tiles_exactly

import fusedlayers.attention.frontend as front_end
import fusedlayers.layers.multihead_attention as mha_module
from fusedlayers import (
    DotProductAttention,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_qkvpacked_func,
    split_packed,
)
from fusedlayers.layers.multihead_attention import MultiheadAttention
from fusedlayers.layers.rope import RotaryPositionEmbedding

pytestmark = pytest.mark.skipif(
    front_end.flash_attention is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="runs the kernels (CUDA, or the Triton CPU interpreter)",
)

S, B, H, D = 12, 2, 2, 16  # tiny: the interpreter runs one program at a time
DTYPES = [torch.float32, torch.float16]


@pytest.fixture
def written(monkeypatch):
    """Records (dq, dk, dv) as the kernels wrote them, and fills every planned gradient buffer
    with NaN first: uninitialized memory may hold anything, so nothing may be left unwritten."""
    launches = []
    backward, buffers = attention_ops.flash_attention_backward, attention_ops.packed_grad_buffers

    def record(*args, **kwargs):
        result = backward(*args, **kwargs)
        launches.append(result[:3])
        return result

    def poisoned(*args):
        grads = buffers(*args)
        for g in grads:
            if g is not None:
                g.fill_(float("nan"))
        return grads

    monkeypatch.setattr(attention_ops, "flash_attention_backward", record)
    monkeypatch.setattr(attention_ops, "packed_grad_buffers", poisoned)
    return launches


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _leaf(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype).requires_grad_()


def _copies(tensors) -> list[torch.Tensor]:
    """Contiguous leaf copies of the same values (the unpacked comparison)."""
    return [t.detach().contiguous().requires_grad_() for t in tensors]


def _assert_no_copy(leaf: torch.Tensor, launches) -> None:
    """The packed gradient lives in the buffer the kernels wrote (one launch per test)."""
    (grads,) = launches
    assert any(_same_storage(leaf.grad, g) for g in grads), "packed gradient was copied"


# ---------------------------------------------------------------------------------- tiling plan


def _views(kind: str) -> list[torch.Tensor]:
    """q/k/v as the kernels see them ([b, s, h, d] or [t, h, d]) for a named memory layout."""
    sb = torch.empty(S, B, 3, H, D)
    return {
        "sb3hd": [sb[:, :, i].transpose(0, 1) for i in range(3)],
        "sbh3d": [t.transpose(0, 1) for t in torch.empty(S, B, H, 3, D).unbind(3)],
        "3bshd": list(torch.empty(3, B, S, H, D).unbind(0)),
        "t3hd": list(torch.empty(S, 3, H, D).unbind(1)),
        "heads": list(torch.empty(B, S, H + 2, D).split([H, 1, 1], 2)),
        "sbhd": [torch.empty(S, B, H, D).transpose(0, 1)],
        "two_of_three": [sb[:, :, i].transpose(0, 1) for i in range(2)],
        "larger_base": [sb[:, :, i, :, : D // 2] for i in range(3)],
        "repeated": [sb[:, :, 0], sb[:, :, 0]],
        "expanded": [torch.empty(B, 1, H, D).expand(B, S, H, D)],
    }[kind]


@pytest.mark.parametrize("kind", ["sb3hd", "sbh3d", "3bshd", "t3hd", "heads", "sbhd"])
def test_plan_groups_views_that_tile_one_buffer(kind):
    views = _views(kind)
    (group,) = plan_packed_grads(*views)
    assert group.members == tuple(range(len(views)))
    assert group.numel == sum(v.numel() for v in views)
    low = min(v.storage_offset() for v in views)
    assert group.offsets == tuple(v.storage_offset() - low for v in views)


@pytest.mark.parametrize("kind", ["two_of_three", "larger_base", "repeated", "expanded"])
def test_plan_refuses_views_that_do_not_tile(kind):
    views = _views(kind)
    assert plan_packed_grads(*views) == ()
    low = min(v.storage_offset() for v in views)
    geometries = tuple((v.shape, v.stride(), v.storage_offset() - low) for v in views)
    assert not tiles_exactly(geometries)


def test_plan_keeps_separate_tensors_apart():
    """Contiguous q and k/v of one kv buffer (bshd_bs2hd): only k and v share a buffer."""
    q = torch.empty(B, S, H, D)
    k, v = torch.empty(B, S, 2, H, D).unbind(2)
    (group,) = plan_packed_grads(q, k, v)
    assert group.members == (1, 2)


@pytest.mark.parametrize("kind", ["separate", "one_tensor_thrice", "reshaped_alias"])
def test_plan_of_tensors_that_fill_their_storage_is_empty(kind):
    """Contiguous tensors that each cover their whole storage: nothing to share (any two on one
    storage overlap), and a contiguous tensor alone needs no strided gradient."""
    q = torch.empty(B, S, H, D)
    tensors = {
        "separate": [q, torch.empty(B, S, H, D), torch.empty(B, S, H, D)],
        "one_tensor_thrice": [q, q, q],
        "reshaped_alias": [q, q.reshape(B, S * H, D), torch.empty(B, S, H, D)],
    }[kind]
    assert plan_packed_grads(*tensors) == ()


# ------------------------------------------------------------------ layouts through the front end


def _dpa(fmt: str, **kwargs) -> DotProductAttention:
    return DotProductAttention(H, D, qkv_format=fmt, deterministic=True, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["sb3hd", "sbh3d"])
def test_dpa_sbhd_packed_matches_contiguous(kernels_on_cpu, written, device, dtype, layout):
    shape, dim = ((S, B, 3, H, D), 2) if layout == "sb3hd" else ((S, B, H, 3, D), 3)
    buf = _leaf(shape, dtype, device)
    attn = _dpa("sbhd", attn_mask_type="causal")
    out = attn(*split_packed(buf, dim))
    dout = torch.randn_like(out)
    out.backward(dout)
    _assert_no_copy(buf, written)
    pieces = _copies(buf.unbind(dim))
    expected = attn(*pieces)
    expected.backward(dout)
    assert torch.equal(out, expected)
    assert torch.equal(buf.grad, torch.stack([p.grad for p in pieces], dim))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qkvpacked_bs3hd_matches_contiguous(written, device, dtype):
    qkv = _leaf((B, S, 3, H, D), dtype, device)
    out = flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _assert_no_copy(qkv, written)
    pieces = _copies(qkv.unbind(2))
    expected = flash_attn_func(*pieces, causal=True, deterministic=True)
    expected.backward(dout)
    assert torch.equal(qkv.grad, torch.stack([p.grad for p in pieces], 2))


def test_kvpacked_bshd_bs2hd_matches_contiguous(written, device):
    q = _leaf((B, S, 2 * H, D), torch.float32, device)  # GQA: 2H query heads, H KV heads
    kv = _leaf((B, S + 3, 2, H, D), torch.float32, device)
    out = flash_attn_kvpacked_func(q, kv, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _assert_no_copy(kv, written)
    q2, k2, v2 = _copies((q, *kv.unbind(2)))
    flash_attn_func(q2, k2, v2, deterministic=True).backward(dout)
    assert torch.equal(q.grad, q2.grad)
    assert torch.equal(kv.grad, torch.stack([k2.grad, v2.grad], 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_qkvpacked_t3hd_matches_contiguous(written, device, dtype):
    cu = torch.tensor([0, 5, 7, 13], dtype=torch.int32, device=device)
    qkv = _leaf((13, 3, H, D), dtype, device)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 6, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    _assert_no_copy(qkv, written)
    pieces = _copies(qkv.unbind(1))
    flash_attn_varlen_func(*pieces, cu, cu, 6, 6, causal=True, deterministic=True).backward(dout)
    assert torch.equal(qkv.grad, torch.stack([p.grad for p in pieces], 1))


def test_dpa_thd_padding_between_sequences_gets_zero(kernels_on_cpu, written, device):
    """TE's cu_seqlens_padded: rows between sequences belong to none and get zero gradient."""
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    padded = torch.tensor([0, 6, 12], dtype=torch.int32, device=device)  # rows 4-5, 11 unowned
    qkv = _leaf((12, 3, H, D), torch.float32, device)
    attn = _dpa("thd", attn_mask_type="padding_causal")
    seqs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded)
    seqs |= dict(cu_seqlens_kv_padded=padded, max_seqlen_q=6, max_seqlen_kv=6)
    out = attn(*split_packed(qkv, 1), **seqs)
    dout = torch.randn_like(out)
    out.backward(dout)
    _assert_no_copy(qkv, written)
    for row in (4, 5, 11):
        assert torch.equal(qkv.grad[row], torch.zeros_like(qkv.grad[row]))
    pieces = _copies(qkv.unbind(1))
    attn(*pieces, **seqs).backward(dout)
    assert torch.equal(qkv.grad, torch.stack([p.grad for p in pieces], 1))


# ------------------------------------------------------------------------ MultiheadAttention


def _contiguous_split(split):
    """split_qkv / split_kv with every piece copied to a fresh tensor (the unpacked baseline)."""
    return lambda *args: tuple(t.contiguous() for t in split(*args))


def _spy_split_packed(monkeypatch, seen: list) -> None:
    """Record each split_packed input and its pieces' gradients as autograd delivers them."""

    def spy(packed, dim, sizes=None):
        pieces = split_packed(packed, dim, sizes)
        packed.register_hook(lambda g: seen.append(("packed", g)))
        for p in pieces:
            p.register_hook(lambda g: seen.append(("piece", g)))
        return pieces

    monkeypatch.setattr(mha_module, "split_packed", spy)


@pytest.mark.parametrize(
    "fused,interleaved,heads,groups,fmt,shared",
    [
        (True, True, 2, 2, "sbhd", True),  # MHA, interleaved per group: q|k|v rows per head
        (True, True, 2, 1, "bshd", True),  # MQA
        (True, False, 4, 2, "thd", True),  # GQA, [all q | all k | all v]
        (False, True, 2, 2, "sbhd", True),  # separate weights stored as one [q | k | v] buffer
        (True, True, 4, 2, "sbhd", False),  # GQA interleaved: q gathered by a copy -> cat
    ],
)
def test_mha_projection_split_matches_contiguous(
    kernels_on_cpu, written, monkeypatch, fused, interleaved, heads, groups, fmt, shared
):
    torch.manual_seed(0)
    module = MultiheadAttention(
        heads * D,
        heads,
        kv_channels=D,
        num_gqa_groups=groups,
        attention_dropout=0.0,
        fuse_qkv_params=fused,
        qkv_weight_interleaved=interleaved,
        qkv_format=fmt,
    )
    module.core_attention.deterministic = True
    baseline = copy.deepcopy(module)
    kwargs = {}
    if fmt == "thd":
        x = torch.randn(11, heads * D)
        kwargs = dict(cu_seqlens_q=torch.tensor([0, 4, 11], dtype=torch.int32), max_seqlen_q=7)
    else:
        x = torch.randn((S, B, heads * D) if fmt == "sbhd" else (B, S, heads * D))
    seen: list = []
    _spy_split_packed(monkeypatch, seen)
    out = module(x, **kwargs)
    dout = torch.randn_like(out)
    out.backward(dout)
    packed = [g for kind, g in seen if kind == "packed"]
    pieces = [g for kind, g in seen if kind == "piece"]
    assert len(packed) == 1 and len(pieces) == 3
    assert all(_same_storage(packed[0], g) for g in pieces) == shared
    monkeypatch.setattr(mha_module, "split_qkv", _contiguous_split(mha_module.split_qkv))
    baseline(x, **kwargs).backward(dout)
    for (name, p), q in zip(module.named_parameters(), baseline.parameters()):
        assert torch.equal(p.grad, q.grad), name


def _graph_nodes(t: torch.Tensor) -> set[str]:
    """The type names of every autograd node behind t."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [next_node for next_node, _ in node.next_functions]
    return {type(node).__name__ for node in seen}


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_mha_with_rope_splits_the_projection_with_torch(kernels_on_cpu, fmt):
    """RoPE gives q and k new tensors, so no buffer could be handed back: the projection is
    split by torch (a C++ autograd node), with the gradients the packed split gives."""
    torch.manual_seed(0)
    module = MultiheadAttention(H * D, H, kv_channels=D, attention_dropout=0.0, qkv_format=fmt)
    module.core_attention.deterministic = True
    baseline = copy.deepcopy(module)
    freqs = RotaryPositionEmbedding(D)(S)
    x = torch.randn((S, B, H * D) if fmt == "sbhd" else (B, S, H * D))
    out = module(x, rotary_pos_emb=freqs)
    assert "_SplitPackedBackward" not in _graph_nodes(out)
    dout = torch.randn_like(out)
    out.backward(dout)
    split_qkv = mha_module.split_qkv
    with pytest.MonkeyPatch.context() as patch:  # the packed split, as before
        patch.setattr(mha_module, "split_qkv", lambda *args: split_qkv(*args[:5]))
        packed_out = baseline(x, rotary_pos_emb=freqs)
    assert "_SplitPackedBackward" in _graph_nodes(packed_out)
    packed_out.backward(dout)
    torch.testing.assert_close(out, packed_out, rtol=0, atol=0)
    for (name, p), q in zip(module.named_parameters(), baseline.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("groups", [2, 1])
def test_mha_rope_pair_and_attention_share_gradient_buffers(kernels_on_cpu, written, groups):
    """RoPE on the kernel: q and k leave the pair launch back to back in one buffer, so the
    attention backward writes dq and dk into one buffer too (poisoned first: every element must
    be written) and the pair's backward reads both in place; every gradient matches the
    reference path's."""
    import fusedlayers.layers.rope as rope_front

    torch.manual_seed(0)
    module = MultiheadAttention(
        4 * D, 4, kv_channels=D, num_gqa_groups=groups, attention_dropout=0.0, qkv_format="bshd"
    )
    module.core_attention.deterministic = True
    reference = copy.deepcopy(module)
    reference.use_reference = True
    freqs = RotaryPositionEmbedding(D)(S)
    x = torch.randn(B, S, 4 * D)
    with pytest.MonkeyPatch.context() as patch:
        original = rope_front._use_kernel
        patch.setattr(rope_front, "_use_kernel", lambda b, *a: original("kernel", *a))
        out = module(x, rotary_pos_emb=freqs)
        dout = torch.randn_like(out)
        out.backward(dout)
    ((dq, dk, _dv),) = written
    assert _same_storage(dq, dk)
    reference(x, rotary_pos_emb=freqs).backward(dout)
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_mha_cross_attention_kv_split_shares_the_buffer(kernels_on_cpu, written, monkeypatch):
    torch.manual_seed(0)
    module = MultiheadAttention(
        H * D, H, attention_dropout=0.0, attention_type="cross", qkv_format="bshd"
    )
    module.core_attention.deterministic = True
    seen: list = []
    _spy_split_packed(monkeypatch, seen)
    x, memory = torch.randn(B, S, H * D), torch.randn(B, S + 2, H * D)
    module(x, encoder_output=memory).backward(torch.randn(B, S, H * D))
    (packed,) = [g for kind, g in seen if kind == "packed"]
    assert all(_same_storage(packed, g) for kind, g in seen if kind == "piece")


# ------------------------------------------------------- autograd semantics and the old path


def test_grad_of_a_piece_and_retain_grad(written, device):
    """The pieces keep their own graph nodes: autograd.grad on one piece and retain_grad work."""
    qkv = _leaf((B, S, 3, H, D), torch.float32, device)
    pieces = _copies(qkv.unbind(2))
    expected = flash_attn_func(*pieces, causal=True, deterministic=True)
    dout = torch.randn_like(expected)
    expected.backward(dout)
    q, k, v = split_packed(qkv, 2)
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)
    (dq,) = torch.autograd.grad(out, [q], dout)
    assert torch.equal(dq, pieces[0].grad)
    assert qkv.grad is None
    q, k, v = split_packed(qkv, 2)
    k.retain_grad()
    flash_attn_func(q, k, v, causal=True, deterministic=True).backward(dout)
    assert torch.equal(k.grad, pieces[1].grad)
    assert torch.equal(qkv.grad, torch.stack([p.grad for p in pieces], 2))


@pytest.mark.parametrize("case", ["two_of_three", "larger_base", "select_views", "rotated_q"])
def test_views_that_do_not_tile_take_the_old_path(written, device, case):
    """Pieces that do not cover their buffer, plain select views, or a piece replaced by a new
    tensor (as RoPE does): gradients are copied as before and stay exact."""
    buf = _leaf((B, S, 3, H, 2 * D if case == "larger_base" else D), torch.float32, device)
    if case == "select_views":
        q, k, v = (buf[:, :, i] for i in range(3))
    else:
        q, k, v = split_packed(buf, 2)
    if case == "two_of_three":
        v = torch.randn_like(v).requires_grad_()
    elif case == "larger_base":
        q, k, v = (t[..., :D] for t in (q, k, v))
    elif case == "rotated_q":
        q = q * 1.5
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    (grads,) = written
    assert not any(_same_storage(buf.grad, g) for g in grads)
    pieces = _copies((q, k, v))
    flash_attn_func(*pieces, causal=True, deterministic=True).backward(dout)
    expected = torch.zeros_like(buf)
    for i, p in enumerate(pieces):
        if case == "two_of_three" and i == 2:
            continue
        scale = 1.5 if case == "rotated_q" and i == 0 else 1.0
        expected[:, :, i, :, :D] = p.grad * scale
    assert torch.equal(buf.grad, expected)


def test_split_packed_is_split_and_unbind():
    """Forward: the same views as split/unbind; without a gradient to track, plain ones."""
    x = torch.randn(4, 7, 3, requires_grad=True)
    for pieces, plain in (
        (split_packed(x, 1, [2, 5]), x.split([2, 5], 1)),
        (split_packed(x, -1), x.unbind(-1)),
    ):
        for a, b in zip(pieces, plain):
            assert a.shape == b.shape and a.stride() == b.stride()
            assert a.storage_offset() == b.storage_offset() and _same_storage(a, b)
    pieces = split_packed(x, 1, [2, 5])
    # Gradients that are not views of one buffer (one missing): concatenated, exactly.
    (pieces[0] * 2).sum().backward()
    expected = torch.cat([torch.full((4, 2, 3), 2.0), torch.zeros(4, 5, 3)], 1)
    assert torch.equal(x.grad, expected)


def test_torch_compile_keeps_fresh_gradients(device):
    """Under torch.compile the custom op runs (outputs may not alias): same gradients."""
    qkv = _leaf((B, S, 3, H, D), torch.float32, device)

    def attend(qkv):
        return flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    out = compiled(qkv)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, [qkv], dout)
    (eager,) = torch.autograd.grad(attend(qkv), [qkv], dout)
    assert torch.equal(grad, eager)
