"""Layers on the Triton kernels vs the same layers with `use_reference=True`, on CUDA, fp16/bf16.

Three copies of each module share weights: `kernel` (low precision, kernel path), `reference`
(low precision, reference path with attention computed in the input dtype: PyTorch's own error,
as design.md's rule asks) and `truth` (fp32, reference path). A kernel output passes when its
error against `truth` is at most twice the reference's, a gradient at most three times (the
kernel harness's factors, tests/attention_testing.py), plus a small atol. Outputs and activation
gradients must also be within TransformerEngine's elementwise test tolerance of the upcast
reference path (`atol = rtol =` fp16 1e-3, bf16 1.5e-2 for DotProductAttention; 5e-2 for
TransformerLayer), which is what TE's attention tests compare. Parameter gradients are sums over
every token (fp16 entries of magnitude 4 to 8 have a unit of 4e-3), so an elementwise rtol of 1e-3
would be a one-unit test there; they get the numerics rule only. Only the attention differs
between the paths, so a failure here points at the kernels or the front end as the layers feed
them.
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch

import fusedlayers.attention.frontend as front_end
import fusedlayers.attention.reference as reference_attention
from fusedlayers.layers.inference import InferenceParams
from fusedlayers.layers.multihead_attention import MultiheadAttention
from fusedlayers.layers.rope import RotaryPositionEmbedding
from fusedlayers.layers.transformer_layer import TransformerLayer

pytestmark = pytest.mark.gpu

HIDDEN, FFN, HEADS, HEAD_DIM = 256, 512, 8, 32
DPA_TOL = {torch.float16: 1e-3, torch.bfloat16: 1.5e-2}
LAYER_TOL = 5e-2
FORMS = {"separate": (False, True), "interleaved": (True, True), "concat": (True, False)}
CU_SEQLENS = [0, 37, 97, 160]  # odd lengths, packed


def _inputs(fmt, dtype, b=2, s=97, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = {"sbhd": (s, b, HIDDEN), "bshd": (b, s, HIDDEN), "thd": (CU_SEQLENS[-1], HIDDEN)}
    return torch.randn(shape[fmt], generator=g, device="cuda", dtype=dtype)


def _thd_kwargs(fmt):
    if fmt != "thd":
        return {}
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32, device="cuda")
    return dict(cu_seqlens_q=cu, max_seqlen_q=63)


def _run(module, inputs, grad_out, kwargs):
    """Output and gradients (inputs first, then parameters), all as fp32."""
    inputs = [t.detach().to(next(module.parameters()).dtype).requires_grad_() for t in inputs]
    out = module(
        *inputs[:1], **kwargs, **({"encoder_output": inputs[1]} if len(inputs) > 1 else {})
    )
    grads = torch.autograd.grad(
        (out * grad_out.to(out.dtype)).sum(), [*inputs, *module.parameters()]
    )
    return [out.float(), *(g.float() for g in grads)]


@contextlib.contextmanager
def _attention_in_input_dtype():
    """Run the reference attention in the input dtype instead of fp32 (PyTorch's own error)."""
    with mock.patch.object(reference_attention, "_compute_dtype", lambda dtype: dtype):
        yield


def _compare(kernel_module, inputs, kwargs, tol):
    """Check every output/gradient of `kernel_module` against reference and fp32 truth."""
    upcast = copy.deepcopy(kernel_module)
    upcast.use_reference = True
    truth = copy.deepcopy(upcast).float()
    out = kernel_module(
        *inputs[:1], **kwargs, **({"encoder_output": inputs[1]} if len(inputs) > 1 else {})
    )
    grad_out = torch.randn_like(out, dtype=torch.float32)
    got = _run(kernel_module, inputs, grad_out, kwargs)
    with _attention_in_input_dtype():
        low = _run(upcast, inputs, grad_out, kwargs)
    near = _run(upcast, inputs, grad_out, kwargs)
    high = _run(truth, inputs, grad_out, kwargs)
    activations = 1 + len(inputs)  # the output, then one gradient per input
    names = ["output", *(f"grad[{i}]" for i in range(len(got) - 1))]
    for n, (name, a, b, c, r) in enumerate(zip(names, got, low, high, near)):
        factor = 2 if n == 0 else 3
        scale = c.abs().max().item() or 1.0
        err = (a - c).abs().max().item()
        base = (b - c).abs().max().item()
        assert err <= factor * base + 1e-5 * scale, (
            f"{name}: kernel error {err:.3e} > {factor} x reference error {base:.3e} "
            f"(scale {scale:.3e})"
        )
        if n < activations:
            # TE's own test criterion, elementwise: |kernel - reference| <= tol + tol * |reference|.
            torch.testing.assert_close(a, r, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


def _mha(dtype, fmt, groups, form, **kwargs):
    torch.manual_seed(0)
    fused, interleaved = FORMS[form]
    return MultiheadAttention(
        HIDDEN,
        HEADS,
        num_gqa_groups=groups,
        kv_channels=HEAD_DIM,
        attention_dropout=0.0,
        input_layernorm=True,
        fuse_qkv_params=fused,
        qkv_weight_interleaved=interleaved,
        qkv_format=fmt,
        params_dtype=dtype,
        device="cuda",
        **kwargs,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("groups", [8, 4, 2, 1])
@pytest.mark.parametrize("form", list(FORMS))
def test_mha_kernel_vs_reference(dtype, fmt, groups, form):
    mha = _mha(dtype, fmt, groups, form)
    _compare(mha, [_inputs(fmt, dtype)], _thd_kwargs(fmt), DPA_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_mha_rope_kernel_vs_reference(dtype, fmt, interleaved):
    mha = _mha(dtype, fmt, 2, "interleaved", rotary_pos_interleaved=interleaved)
    table = RotaryPositionEmbedding(HEAD_DIM, rotary_percent=0.5, interleaved=interleaved)
    kwargs = dict(_thd_kwargs(fmt), rotary_pos_emb=table.cuda()(128))
    _compare(mha, [_inputs(fmt, dtype)], kwargs, DPA_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("groups", [8, 2, 1])
def test_cross_attention_kernel_vs_reference(dtype, fmt, groups):
    mha = _mha(dtype, fmt, groups, "interleaved", attention_type="cross", attn_mask_type="no_mask")
    inputs = [_inputs(fmt, dtype, s=97), _inputs(fmt, dtype, s=64, seed=1)]
    _compare(mha, inputs, {}, DPA_TOL[dtype])


LAYER_CONFIGS = {
    "pre_ln": {},
    "post_ln": dict(apply_residual_connection_post_layernorm=True),
    "output_layernorm": dict(output_layernorm=True),
    "rmsnorm_swiglu": dict(normalization="RMSNorm", activation="swiglu", bias=False),
    "decoder": dict(layer_type="decoder"),
}


# Every config in every format, but decoder layers in sbhd/bshd only (their cross-attention to
# an encoder's output is tested there).
LAYER_CASES = [
    (config, fmt)
    for config in LAYER_CONFIGS
    for fmt in ("sbhd", "bshd", "thd")
    if not (config == "decoder" and fmt == "thd")
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("config, fmt", LAYER_CASES)
def test_transformer_layer_kernel_vs_reference(dtype, fmt, form, config):
    torch.manual_seed(0)
    fused, interleaved = FORMS[form]
    layer = TransformerLayer(
        HIDDEN,
        FFN,
        HEADS,
        num_gqa_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        fuse_qkv_params=fused,
        qkv_weight_interleaved=interleaved,
        attn_input_format=fmt,
        params_dtype=dtype,
        device="cuda",
        **LAYER_CONFIGS[config],
    )
    inputs = [_inputs(fmt, dtype)]
    if config == "decoder":
        inputs.append(_inputs(fmt, dtype, s=64, seed=1))
    _compare(layer, inputs, _thd_kwargs(fmt), LAYER_TOL)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("groups", [8, 4, 1])
def test_projection_reaches_kernels_without_copy(monkeypatch, form, groups):
    """The QKV views (TE issue 1195's layouts included) are read in place by the kernels."""
    copies = []
    original = front_end.prepare

    def recording(*args, **kwargs):
        prepared = original(*args, **kwargs)
        copies.extend(prepared.copies)
        return prepared

    monkeypatch.setattr(front_end, "prepare", recording)
    mha = _mha(torch.bfloat16, "sbhd", groups, form)
    x = _inputs("sbhd", torch.bfloat16)
    mha(x).float().sum().backward()
    assert copies == []


@pytest.mark.parametrize("groups", [8, 2, 1])
def test_kv_cache_generation_on_kernels(groups):
    torch.manual_seed(0)
    layers = [
        TransformerLayer(
            HIDDEN,
            FFN,
            HEADS,
            num_gqa_groups=groups,
            layer_number=n,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            fuse_qkv_params=True,
            params_dtype=torch.bfloat16,
            device="cuda",
        ).eval()
        for n in (1, 2)
    ]
    table = RotaryPositionEmbedding(HEAD_DIM).cuda()(256)
    x = _inputs("sbhd", torch.bfloat16, s=70)

    def run(t, **kwargs):
        for layer in layers:
            t = layer(t, rotary_pos_emb=table, **kwargs)
        return t

    with torch.no_grad():
        full = run(x).float()
        params = InferenceParams(max_batch_size=2, max_sequence_length=256)
        start = 0
        for n in (64, 1, 1, 4):
            step = run(x[start : start + n], inference_params=params).float()
            want = full[start : start + n]
            scale = want.abs().max().item()
            assert (step - want).abs().max().item() <= DPA_TOL[torch.bfloat16] * scale
            params.sequence_len_offset += n
            start += n


def test_checkpoint_core_attention_on_kernels():
    mha = _mha(torch.bfloat16, "bshd", 2, "interleaved")
    x = _inputs("bshd", torch.bfloat16).requires_grad_()
    grads = []
    for flag in (False, True):
        out = mha(x, checkpoint_core_attention=flag)
        grads.append(torch.autograd.grad(out.float().square().sum(), [x, *mha.parameters()]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-2 * b.abs().max().item(), rtol=0)
