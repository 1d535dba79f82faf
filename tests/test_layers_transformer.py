"""TransformerLayer (and LayerNormMLP inside it) on CPU in fp64 against the independent oracle in
`test_layers_oracle.py`, dropout off: formats, head divisors, QKV storage forms, pre/post-LN,
output LayerNorm, encoder/decoder, every activation, RMSNorm, zero-centered gamma, no bias, RoPE;
outputs and gradients, and gradcheck."""

from __future__ import annotations

import pytest
import test_layers_oracle as oracle
import torch

from fusedlayers.layers.mlp import ACTIVATIONS
from fusedlayers.layers.rope import RotaryPositionEmbedding
from fusedlayers.layers.transformer_layer import TransformerLayer

HIDDEN, FFN, HEADS = 32, 48, 4
FORMS = {"separate": (False, True), "interleaved": (True, True), "concat": (True, False)}
CU_SEQLENS = [0, 3, 8, 10]


def make_layer(fmt="sbhd", form="separate", groups=2, **kwargs):
    fused, interleaved = FORMS[form]
    options = dict(
        num_gqa_groups=groups,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        fuse_qkv_params=fused,
        qkv_weight_interleaved=interleaved,
        attn_input_format=fmt,
        params_dtype=torch.float64,
    )
    options.update(kwargs)
    layer = TransformerLayer(HIDDEN, FFN, HEADS, **options)
    with torch.no_grad():  # move norms and biases off their init values so errors show
        for name, p in layer.named_parameters():
            if "bias" in name or "layer_norm" in name or name.startswith("layernorm."):
                p.add_(0.1 * torch.randn_like(p))
    return layer


def make_input(fmt, b=2, s=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = {"sbhd": (s, b, HIDDEN), "bshd": (b, s, HIDDEN), "thd": (CU_SEQLENS[-1], HIDDEN)}
    return torch.randn(shape[fmt], generator=g, dtype=torch.float64, requires_grad=True)


def run_both(layer, fmt, x, enc=None, d_rot=None, mask_type="causal"):
    """(layer output, oracle output), in the layer's format."""
    kwargs = {}
    if d_rot is not None:
        kwargs["rotary_pos_emb"] = RotaryPositionEmbedding(d_rot)(16).double()
    if enc is not None:
        kwargs["encoder_output"] = enc
    if fmt == "thd":
        cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
        out = layer(x, cu_seqlens_q=cu, max_seqlen_q=5, self_attn_mask_type=mask_type, **kwargs)
        refs = [
            oracle.transformer_layer(layer, x[a:b][None], None, mask_type, d_rot)[0]
            for a, b in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:])
        ]
        return out, torch.cat(refs)
    out = layer(x, self_attn_mask_type=mask_type, **kwargs)
    enc_bsh = None if enc is None else oracle.to_bshd(enc, fmt)
    ref = oracle.transformer_layer(layer, oracle.to_bshd(x, fmt), enc_bsh, mask_type, d_rot)
    return out, oracle.from_bshd(ref, fmt)


def check(out, ref, tensors):
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), tensors)
    want = torch.autograd.grad((ref * g).sum(), tensors)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("rope", [False, True])
def test_formats_and_storage(fmt, form, rope):
    torch.manual_seed(0)
    layer = make_layer(fmt, form)
    x = make_input(fmt)
    out, ref = run_both(layer, fmt, x, d_rot=8 if rope else None)
    check(out, ref, [x, *layer.parameters()])


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_head_divisors(groups):
    torch.manual_seed(1)
    layer = make_layer("bshd", "interleaved", groups)
    x = make_input("bshd")
    out, ref = run_both(layer, "bshd", x)
    check(out, ref, [x, *layer.parameters()])


VARIANTS = {
    "post_ln_residual": dict(apply_residual_connection_post_layernorm=True),
    "output_layernorm": dict(output_layernorm=True),
    "output_layernorm_post_residual": dict(
        output_layernorm=True, apply_residual_connection_post_layernorm=True
    ),
    "rmsnorm": dict(normalization="RMSNorm"),
    "zero_centered_gamma": dict(zero_centered_gamma=True),
    "no_bias": dict(bias=False),
    "rmsnorm_no_bias_swiglu": dict(normalization="RMSNorm", bias=False, activation="swiglu"),
    "kv_channels": dict(kv_channels=6),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_variants(variant):
    torch.manual_seed(2)
    layer = make_layer("sbhd", "concat", **VARIANTS[variant])
    x = make_input("sbhd")
    out, ref = run_both(layer, "sbhd", x)
    check(out, ref, [x, *layer.parameters()])


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activations(activation):
    torch.manual_seed(3)
    layer = make_layer("bshd", activation=activation)
    gated = activation.endswith("glu")
    assert layer.layernorm_mlp.fc1_weight.shape == ((2 if gated else 1) * FFN, HIDDEN)
    x = make_input("bshd")
    out, ref = run_both(layer, "bshd", x)
    check(out, ref, [x, *layer.parameters()])


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("post_ln", [False, True])
def test_decoder(fmt, form, post_ln):
    torch.manual_seed(4)
    layer = make_layer(
        fmt, form, layer_type="decoder", apply_residual_connection_post_layernorm=post_ln
    )
    x = make_input(fmt, s=5, seed=1)
    enc = make_input(fmt, s=7, seed=2)
    out, ref = run_both(layer, fmt, x, enc=enc)
    check(out, ref, [x, enc, *layer.parameters()])


def test_hidden_dropout_is_active_in_training_only():
    layer = make_layer("sbhd", hidden_dropout=0.5)
    x = make_input("sbhd")
    layer.eval()
    out, ref = run_both(layer, "sbhd", x)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    layer.train()
    assert not torch.allclose(layer(x), ref)


def test_gradcheck_reference_path():
    torch.manual_seed(5)
    layer = TransformerLayer(
        8,
        12,
        2,
        num_gqa_groups=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation="swiglu",
        params_dtype=torch.float64,
        use_reference=True,
    )
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))


def test_invalid_layer_type():
    with pytest.raises(ValueError, match="layer_type"):
        TransformerLayer(HIDDEN, FFN, HEADS, layer_type="bidirectional")
    with pytest.raises(ValueError, match="activation"):
        TransformerLayer(HIDDEN, FFN, HEADS, activation="tanh")


def test_decoder_thd():
    """Packed decoder: self-attention over cu_seqlens_q, cross-attention to cu_seqlens_kv."""
    torch.manual_seed(6)
    layer = make_layer("thd", "interleaved", layer_type="decoder")
    cu_q, cu_kv = CU_SEQLENS, [0, 4, 6, 12]
    x = make_input("thd")
    enc = torch.randn(cu_kv[-1], HIDDEN, dtype=torch.float64, requires_grad=True)
    out = layer(
        x,
        encoder_output=enc,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_kv=torch.tensor(cu_kv, dtype=torch.int32),
        max_seqlen_q=5,
        max_seqlen_kv=6,
    )
    refs = [
        oracle.transformer_layer(layer, x[a:b][None], enc[c:d][None])[0]
        for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_kv[:-1], cu_kv[1:])
    ]
    check(out, torch.cat(refs), [x, enc, *layer.parameters()])


def test_torch_compile_fullgraph():
    """The layer traces as one graph (split QKV parameters included) and computes the same."""
    torch.manual_seed(7)
    layer = make_layer("sbhd", "separate").eval()
    x = make_input("sbhd").detach()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), atol=1e-12, rtol=0)
