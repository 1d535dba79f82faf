"""MultiheadAttention on CPU (fp64, reference attention) against the independent oracle in
`test_layers_oracle.py`: every format, every head-count divisor down to MQA, every QKV storage
form, RoPE on and off, self and cross attention, outputs and gradients; plus the no-copy views,
checkpointing and gradcheck."""

from __future__ import annotations

import pytest
import test_layers_oracle as oracle
import torch

import fusedlayers.attention.dot_product_attention as dpa_module
from fusedlayers.layers.multihead_attention import MultiheadAttention
from fusedlayers.layers.rope import RotaryPositionEmbedding

HIDDEN, HEADS, HEAD_DIM = 32, 4, 8
FORMS = {"separate": (False, True), "interleaved": (True, True), "concat": (True, False)}
CU_SEQLENS = [0, 4, 9, 11]  # three sequences packed for thd


def make_mha(form="separate", groups=HEADS, fmt="sbhd", **kwargs):
    fused, interleaved = FORMS[form]
    options = dict(
        num_gqa_groups=groups,
        kv_channels=HEAD_DIM,
        attention_dropout=0.0,
        fuse_qkv_params=fused,
        qkv_weight_interleaved=interleaved,
        qkv_format=fmt,
        params_dtype=torch.float64,
        input_layernorm=True,
    )
    options.update(kwargs)
    mha = MultiheadAttention(HIDDEN, HEADS, **options)
    with torch.no_grad():  # non-trivial norm and bias parameters, so the test sees them
        for name, p in mha.named_parameters():
            if "bias" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return mha


def inputs(fmt, b=2, s=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = {"sbhd": (s, b, HIDDEN), "bshd": (b, s, HIDDEN), "thd": (CU_SEQLENS[-1], HIDDEN)}
    return torch.randn(shape[fmt], generator=g, dtype=torch.float64, requires_grad=True)


def oracle_self(mha, x, fmt, mask_type="causal", d_rot=None, interleaved=False):
    """The oracle's output in the layer's format (thd: each packed sequence on its own)."""
    if fmt != "thd":
        out, _ = oracle.mha_self(mha, oracle.to_bshd(x, fmt), mask_type, d_rot, None, interleaved)
        return oracle.from_bshd(out, fmt)
    outs = []
    for start, end in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]):
        out, _ = oracle.mha_self(mha, x[start:end][None], mask_type, d_rot, None, interleaved)
        outs.append(out[0])
    return torch.cat(outs)


def thd_kwargs(fmt):
    if fmt != "thd":
        return {}
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    return dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)


def assert_same_grads(out, ref, tensors):
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), tensors)
    want = torch.autograd.grad((ref * g).sum(), tensors)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("rope", [None, "half", "interleaved-partial"])
def test_self_attention_matches_oracle(fmt, groups, form, rope):
    torch.manual_seed(1)
    interleaved = rope == "interleaved-partial"
    mha = make_mha(form, groups, fmt, rotary_pos_interleaved=interleaved)
    x = inputs(fmt)
    kwargs = thd_kwargs(fmt)
    d_rot = None
    if rope is not None:
        percent = 0.5 if interleaved else 1.0
        table = RotaryPositionEmbedding(HEAD_DIM, rotary_percent=percent, interleaved=interleaved)
        kwargs["rotary_pos_emb"] = table(16).double()
        d_rot = int(HEAD_DIM * percent)
    out = mha(x, **kwargs)
    ref = oracle_self(mha, x, fmt, "causal", d_rot, interleaved)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert_same_grads(out, ref, [x, *mha.parameters()])


@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
@pytest.mark.parametrize("input_layernorm", [True, False])
def test_mask_types_and_plain_qkv(mask_type, input_layernorm):
    torch.manual_seed(2)
    mha = make_mha("interleaved", 2, "bshd", input_layernorm=input_layernorm)
    x = inputs("bshd")
    ref = oracle_self(mha, x, "bshd", mask_type)
    torch.testing.assert_close(mha(x, attn_mask_type=mask_type), ref, atol=1e-10, rtol=1e-10)
    assert ("layernorm_qkv" in dict(mha.named_children())) == input_layernorm


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("form", list(FORMS))
def test_cross_attention_matches_oracle(fmt, groups, form):
    torch.manual_seed(3)
    mha = make_mha(form, groups, fmt, attention_type="cross", attn_mask_type="no_mask")
    x = inputs(fmt, s=5, seed=1)
    enc = inputs(fmt, s=7, seed=2)
    out = mha(x, encoder_output=enc)
    ref, _ = oracle.mha_cross(mha, oracle.to_bshd(x, fmt), oracle.to_bshd(enc, fmt))
    ref = oracle.from_bshd(ref, fmt)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert_same_grads(out, ref, [x, enc, *mha.parameters()])


def test_rope_pair_and_single_table_agree():
    torch.manual_seed(4)
    mha = make_mha("concat", 2, "sbhd")
    x = inputs("sbhd")
    table = RotaryPositionEmbedding(HEAD_DIM)(8).double()
    torch.testing.assert_close(mha(x, rotary_pos_emb=table), mha(x, rotary_pos_emb=(table, table)))


def _captured_qkv(mha, x):
    seen = {}

    def hook(_module, args):
        seen["q"], seen["k"], seen["v"] = args[:3]

    handle = mha.core_attention.register_forward_pre_hook(hook)
    mha(x)
    handle.remove()
    return seen["q"], seen["k"], seen["v"]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_projection_reaches_attention_as_views(form, groups):
    """k and v (and q, except interleaved GQA) are strided views of the one projection output."""
    mha = make_mha(form, groups, "sbhd")
    q, k, v = _captured_qkv(mha, inputs("sbhd"))
    storage = k.untyped_storage().data_ptr()
    assert v.untyped_storage().data_ptr() == storage
    assert not k.is_contiguous() and not v.is_contiguous()
    row = (HEADS + 2 * groups) * HEAD_DIM  # elements per token of the projection output
    assert k.stride()[:2] == (2 * row, row)  # [s, b, g, d] view into [s, b, row]
    q_is_view = not (form == "interleaved" and 1 < groups < HEADS)
    assert (q.untyped_storage().data_ptr() == storage) == q_is_view


def test_separate_params_are_views_of_one_buffer():
    mha = make_mha("separate", 2)
    lin = mha.layernorm_qkv

    def storage(t):
        return t.untyped_storage().data_ptr()

    assert storage(lin.key_weight) == storage(lin.query_weight)
    assert storage(lin.value_bias) == storage(lin.query_bias)
    joined = lin.joined_weight()
    assert joined.data_ptr() == lin.query_weight.data_ptr() and joined.shape[0] == 8 * HEAD_DIM
    mha.float()  # .to() gives every slice its own storage: the module packs them again
    assert storage(lin.key_weight) == storage(lin.query_weight) != storage(lin.value_bias)


def test_checkpoint_core_attention_recomputes(monkeypatch):
    calls = []
    original = dpa_module.attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(dpa_module, "attention", counting)
    torch.manual_seed(5)
    mha = make_mha("interleaved", 2, "sbhd")
    x = inputs("sbhd")
    grads = []
    for use_checkpoint in (False, True):
        calls.clear()
        out = mha(x, checkpoint_core_attention=use_checkpoint)
        grads.append(torch.autograd.grad(out.square().sum(), [x, *mha.parameters()]))
        assert len(calls) == (2 if use_checkpoint else 1)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_return_layernorm_output():
    mha = make_mha("concat", 2, "bshd", return_layernorm_output=True)
    x = inputs("bshd")
    out, ln = mha(x)
    ref, ref_ln = oracle.mha_self(mha, x, "causal")
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ln, ref_ln, atol=1e-10, rtol=1e-10)


def test_gradcheck_reference_path():
    torch.manual_seed(6)
    mha = MultiheadAttention(
        8,
        2,
        num_gqa_groups=1,
        attention_dropout=0.0,
        input_layernorm=True,
        fuse_qkv_params=True,
        params_dtype=torch.float64,
        use_reference=True,
    )
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    table = RotaryPositionEmbedding(4)(4).double()
    assert torch.autograd.gradcheck(lambda t: mha(t, rotary_pos_emb=table), (x,))


def test_invalid_arguments():
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\).*num_gqa_groups \(3\)"):
        MultiheadAttention(HIDDEN, 4, num_gqa_groups=3)
    with pytest.raises(ValueError, match="attention_type"):
        MultiheadAttention(HIDDEN, 4, attention_type="both")
    with pytest.raises(ValueError, match="encoder_output"):
        make_mha(attention_type="cross")(inputs("sbhd"))


def test_thd_with_padding_between_sequences():
    """Sequences at padded offsets: RoPE positions and attention follow each sequence's rows."""
    torch.manual_seed(7)
    mha = make_mha("interleaved", 2, "thd")
    lengths, starts = [4, 5, 2], [0, 6, 12]
    cu = torch.tensor([0, 4, 9, 11], dtype=torch.int32)
    cu_padded = torch.tensor(starts + [16], dtype=torch.int32)
    x = torch.randn(16, HIDDEN, dtype=torch.float64, requires_grad=True)
    table = RotaryPositionEmbedding(HEAD_DIM)(8).double()
    out = mha(
        x, cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded, max_seqlen_q=5, rotary_pos_emb=table
    )
    rows = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lengths)])
    refs = [
        oracle.mha_self(mha, x[a : a + n][None], "causal", HEAD_DIM)[0][0]
        for a, n in zip(starts, lengths)
    ]
    ref = torch.cat(refs)
    torch.testing.assert_close(out[rows], ref, atol=1e-10, rtol=1e-10)
    assert_same_grads(out[rows], ref, [x, *mha.parameters()])
