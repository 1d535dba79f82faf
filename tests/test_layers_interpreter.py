"""MultiheadAttention with its attention on the Triton kernels under the CPU interpreter, against
the same module on the reference path: the projection's strided q/k/v views (TE issue 1195's
layouts among them) must be read correctly by the kernels, forward and backward. On CUDA the GPU
tests cover this in low precision; here it runs in fp32 on every CPU test run."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import fusedlayers.attention.frontend as front_end
from fusedlayers.layers.multihead_attention import MultiheadAttention

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available()
    or os.environ.get("TRITON_INTERPRET") != "1"
    or front_end.flash_attention is None,
    reason="runs the kernels under the Triton CPU interpreter",
)

HIDDEN, HEADS, HEAD_DIM = 32, 4, 16
FORMS = {"separate": (False, True), "interleaved": (True, True), "concat": (True, False)}


@pytest.mark.parametrize(
    "form,groups,fmt",
    [
        ("interleaved", 2, "sbhd"),  # GQA + interleaved: strided k/v views (issue 1195)
        ("interleaved", 1, "bshd"),  # MQA
        ("concat", 2, "sbhd"),
        ("separate", 4, "thd"),
    ],
)
def test_kernels_read_projection_views(kernels_on_cpu, form, groups, fmt):
    torch.manual_seed(0)
    fused, interleaved = FORMS[form]
    kernel = MultiheadAttention(
        HIDDEN,
        HEADS,
        num_gqa_groups=groups,
        kv_channels=HEAD_DIM,
        attention_dropout=0.0,
        input_layernorm=True,
        fuse_qkv_params=fused,
        qkv_weight_interleaved=interleaved,
        qkv_format=fmt,
    )
    reference = copy.deepcopy(kernel)
    reference.use_reference = True
    kwargs = {}
    if fmt == "thd":
        x = torch.randn(11, HIDDEN)
        cu = torch.tensor([0, 4, 11], dtype=torch.int32)
        kwargs = dict(cu_seqlens_q=cu, max_seqlen_q=7)
    else:
        x = torch.randn((7, 2, HIDDEN) if fmt == "sbhd" else (2, 7, HIDDEN))
    outs, grads = [], []
    for module in (kernel, reference):
        inp = x.clone().requires_grad_()
        out = module(inp, **kwargs)
        outs.append(out)
        grads.append(torch.autograd.grad(out.sin().sum(), [inp, *module.parameters()]))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_transformer_layer_repeats_take_the_planned_attention_call(kernels_on_cpu, monkeypatch):
    """A TransformerLayer's attention call repeats one signature every step: from the second
    step it launches the call the front end planned on the first (`plan_call`), and each step
    still matches the reference path on its own fresh input, forward and backward."""
    from fusedlayers.layers.transformer_layer import TransformerLayer

    monkeypatch.setattr(front_end, "_VALIDATED", {})
    planned = []
    real = front_end.flash_attention_planned
    monkeypatch.setattr(
        front_end, "flash_attention_planned", lambda *a: planned.append(1) or real(*a)
    )
    torch.manual_seed(0)
    kernel = TransformerLayer(
        HIDDEN, 2 * HIDDEN, HEADS, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
        fuse_qkv_params=True, attn_input_format="sbhd",
    )  # fmt: skip
    reference = copy.deepcopy(kernel)
    reference.use_reference = True
    for step in range(3):
        x = torch.randn(7, 2, HIDDEN)
        outs, grads = [], []
        for module in (kernel, reference):
            inp = x.clone().requires_grad_()
            out = module(inp)
            outs.append(out)
            grads.append(torch.autograd.grad(out.sin().sum(), [inp, *module.parameters()]))
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5, msg=f"step {step}")
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert len(planned) == 2
