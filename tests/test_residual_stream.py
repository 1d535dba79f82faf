"""The residual stream (`residual=` / `return_residual=`): a pre-LN TransformerLayer on `(h, r)`
computes what the layer computes on `h + r`, a chain of layers carrying the stream equals the
plain chain, and GPT (which carries it) gives the plain chain's logits, gradients and tokens.

Each comparison runs on the reference path (`use_reference=True`) and on the kernel path (every
norm, activation, RoPE and attention call on its Triton kernel, under the CPU interpreter
without CUDA). The stream moves an add into the following norm; the fused add-norm rounds the
sum as torch's add does and normalizes that sum (tests/test_add_norm.py), and dropout draws the
same masks in the same order, so results and gradients are compared bit for bit.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from fusedlayers.models import GPT
from test_gpt import small_config

import fusedlayers.attention.frontend as attention_front
import fusedlayers.layers.mlp as mlp
import fusedlayers.layers.normalization as normalization
import fusedlayers.layers.rope as rope
from fusedlayers.layers.linear import LayerNormLinear
from fusedlayers.layers.multihead_attention import MultiheadAttention
from fusedlayers.layers.normalization import LayerNorm, RMSNorm
from fusedlayers.layers.transformer_layer import TransformerLayer

HIDDEN, FFN, HEADS = 32, 48, 4
INTERPRETER = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"

# TransformerLayer variants (keyword arguments): norms, layer types, GQA/MQA, bias, activations,
# QKV storage forms and input formats.
LAYERS = {
    "layernorm-encoder-gelu": dict(),
    "rmsnorm-encoder-gqa-swiglu-nobias": dict(
        normalization="RMSNorm", num_gqa_groups=2, activation="swiglu", bias=False,
        fuse_qkv_params=True,
    ),
    "layernorm-decoder-mqa-relu-zc": dict(
        layer_type="decoder", num_gqa_groups=1, activation="relu", zero_centered_gamma=True
    ),
    "rmsnorm-decoder-qgeglu-bshd": dict(
        normalization="RMSNorm", layer_type="decoder", activation="qgeglu",
        attn_input_format="bshd",
    ),
    "layernorm-encoder-srelu-thd": dict(
        activation="srelu", attn_input_format="thd", fuse_qkv_params=True,
        qkv_weight_interleaved=False,
    ),
}  # fmt: skip


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    """`kernel`: calls that ask for `auto` run the Triton kernels, as on CUDA (CPU tensors
    need the interpreter); `reference`: the modules are built with `use_reference=True`."""
    if request.param == "kernel":
        if not INTERPRETER:
            pytest.skip("the kernel path on CPU tensors runs under the Triton interpreter")
        for module, name in (
            (normalization, "_use_kernel"),
            (mlp, "_use_kernel"),
            (rope, "_use_kernel"),
            (attention_front, "choose_backend"),
        ):
            original = getattr(module, name)

            def choose(backend, *args, original=original):
                return original("kernel" if backend == "auto" else backend, *args)

            monkeypatch.setattr(module, name, choose)
    return request.param


@contextlib.contextmanager
def plain_chain():
    """GPT runs its layers the plain way (each layer adds its own residual, the final norm has
    none to add): what it did before the stream."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TransformerLayer, "supports_residual_stream", property(lambda self: False))
        yield


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random parameters, norm scales around their neutral value (so no weight is 1 or 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            neutral = name.endswith("weight") and p.dim() == 1 and not module_zero_centered(module)
            p.copy_(noise * (0.2 if p.dim() == 1 else 0.3) + (1.0 if neutral else 0.0))
    return module


def module_zero_centered(module: torch.nn.Module) -> bool:
    return any(getattr(m, "zero_centered_gamma", False) for m in module.modules())


def make_layer(name: str, path: str, dtype: torch.dtype, seed: int, **overrides):
    torch.manual_seed(seed)
    layer = TransformerLayer(
        HIDDEN, FFN, HEADS, params_dtype=dtype, use_reference=path == "reference",
        **{**LAYERS[name], **overrides},
    )  # fmt: skip
    return randomize(layer, seed).eval()


def make_inputs(layer: TransformerLayer, dtype: torch.dtype, seed: int):
    """(h, r, forward keyword arguments): random hidden states and residual in the layer's
    format, with an encoder output for a decoder and the sequence offsets for thd."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"sbhd": (6, 2, HIDDEN), "bshd": (2, 6, HIDDEN), "thd": (11, HIDDEN)}
    fmt = layer.attn_input_format
    h, r = (torch.randn(shapes[fmt], generator=g).to(dtype) for _ in range(2))
    kwargs = {}
    if fmt == "thd":
        kwargs = dict(cu_seqlens_q=torch.tensor([0, 5, 11], dtype=torch.int32), max_seqlen_q=6)
    if layer.layer_type == "decoder":
        encoder_shape = {"sbhd": (4, 2, HIDDEN), "bshd": (2, 4, HIDDEN)}[fmt]
        kwargs["encoder_output"] = torch.randn(encoder_shape, generator=g).to(dtype)
    return h, r, kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", LAYERS)
def test_layer_on_the_stream_equals_the_layer_on_the_sum(path, name, dtype):
    first = make_layer(name, path, dtype, seed=1)
    second = make_layer(name, path, dtype, seed=2)
    h, r, kw = make_inputs(first, dtype, seed=3)
    with torch.no_grad():
        out, residual = first(h, residual=r, return_residual=True, **kw)
        assert torch.equal(residual + out, first(h + r, **kw))
        # The first layer of a stack takes no residual and still hands its two parts on.
        out_0, residual_0 = first(h, return_residual=True, **kw)
        assert torch.equal(residual_0 + out_0, first(h, **kw))
        # Two layers carrying the stream equal the plain chain; residual= alone gives the sum.
        plain = second(first(h + r, **kw), **kw)
        out_2, residual_2 = second(out, residual=residual, return_residual=True, **kw)
        assert torch.equal(residual_2 + out_2, plain)
        assert torch.equal(second(out, residual=residual, **kw), plain)


@pytest.mark.parametrize("name", LAYERS)
def test_default_forward_computes_what_explicit_adds_compute(path, name):
    """With default arguments a layer computes what it did before its adds moved into norms:
    the same layer with every add explicit (`_fuse_residual` off) gives the same output."""
    layer = make_layer(name, path, torch.float32, seed=4)
    h, _, kw = make_inputs(layer, torch.float32, seed=5)
    with torch.no_grad():
        fused = layer(h, **kw)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(TransformerLayer, "_fuse_residual", lambda *args: False)
            assert torch.equal(fused, layer(h, **kw))


@pytest.mark.parametrize("name", ["layernorm-encoder-gelu", "rmsnorm-decoder-qgeglu-bshd"])
def test_training_with_dropout_forward_and_gradients_equal_the_plain_chain(path, name):
    """In training with hidden dropout the stream draws the same masks in the same order (the
    pre-MLP add then stays explicit, the add between layers still moves into the norm): the
    same output and the same gradients for the inputs and every parameter."""
    layers = [make_layer(name, path, torch.float32, seed, hidden_dropout=0.2) for seed in (6, 7)]
    for layer in layers:
        layer.train()
    h, r, kw = make_inputs(layers[0], torch.float32, seed=8)
    grad_out = torch.randn(h.shape, generator=torch.Generator().manual_seed(9))
    params = [p for layer in layers for p in layer.parameters()]

    def run(stream: bool):
        inp, res = h.clone().requires_grad_(), r.clone().requires_grad_()
        torch.manual_seed(10)
        if stream:
            out, residual = layers[0](inp, residual=res, return_residual=True, **kw)
            out, residual = layers[1](out, residual=residual, return_residual=True, **kw)
            y = residual + out
        else:
            y = layers[1](layers[0](inp + res, **kw), **kw)
        return y, torch.autograd.grad(y, [inp, res, *params], grad_out)

    y, grads = run(stream=True)
    y_plain, grads_plain = run(stream=False)
    assert torch.equal(y, y_plain)
    for got, expected in zip(grads, grads_plain):
        # Bitwise too: the fused add-norm's backward adds the norm's input gradient and the
        # sum's own gradient in fp32 inside its kernel, the one add autograd makes here.
        assert torch.equal(got, expected)


def _counting_norm_kernels(monkeypatch) -> dict:
    """Count the norm kernels' calls: `layer_norm` (a plain norm) and `add_layer_norm` (a
    residual add fused into a norm)."""
    counts = {"layer_norm": 0, "add_layer_norm": 0}
    for name in counts:
        original = getattr(normalization, name)

        def counted(*args, name=name, original=original, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(normalization, name, counted)
    return counts


@pytest.mark.skipif(not INTERPRETER, reason="runs the norm kernels under the Triton interpreter")
def test_gpt_runs_every_residual_add_inside_a_norm_kernel(monkeypatch):
    """n layers: the plain chain runs n + 1 plain norms and n add-norms (the pre-MLP adds) plus
    n separate adds; the stream runs one plain norm (the first layer's input) and 2n add-norms."""
    monkeypatch.setattr(normalization, "KERNEL_MIN_HIDDEN", 1)  # CUDA's choice, at any size
    monkeypatch.setattr(
        normalization, "_use_kernel", lambda backend, *args: (backend == "auto", "test")
    )
    counts = _counting_norm_kernels(monkeypatch)
    model = randomize(GPT(small_config(n_layer=3)), 11).eval()
    idx = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        logits = model(idx)
        assert counts == {"layer_norm": 1, "add_layer_norm": 6}
        counts.update(layer_norm=0, add_layer_norm=0)
        with plain_chain():
            assert torch.equal(logits, model(idx))
        assert counts == {"layer_norm": 4, "add_layer_norm": 3}


GPT_CONFIGS = [
    dict(),  # bshd, RoPE, RMSNorm, SwiGLU, GQA
    dict(attn_input_format="sbhd", pos_emb="learned", normalization="LayerNorm", bias=True,
         activation="gelu"),
    dict(attn_input_format="thd", n_kv_head=1, tie_embeddings=False),
]  # fmt: skip


@pytest.mark.parametrize("overrides", GPT_CONFIGS, ids=["bshd", "sbhd", "thd"])
def test_gpt_logits_and_gradients_equal_the_plain_chain(path, overrides):
    """Training mode with hidden dropout: the same logits and parameter gradients."""
    config = small_config(hidden_dropout=0.1, **overrides)
    model = randomize(GPT(config, use_reference=path == "reference"), 13).train()
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(14))
    grad_logits = torch.randn(2, 12, 256, generator=torch.Generator().manual_seed(15))

    def run():
        torch.manual_seed(16)
        logits = model(idx)
        return logits, torch.autograd.grad(logits, list(model.parameters()), grad_logits)

    logits, grads = run()
    with plain_chain():
        logits_plain, grads_plain = run()
    assert torch.equal(logits, logits_plain)
    for (name, _), got, expected in zip(model.named_parameters(), grads, grads_plain):
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("overrides", GPT_CONFIGS[:2], ids=["bshd", "sbhd"])
def test_gpt_greedy_generation_equals_the_plain_chain(path, overrides):
    """`generate` with the KV cache (the prompt, then one token per step): the same tokens, and
    the same last-step logits."""
    model = randomize(GPT(small_config(**overrides), use_reference=path == "reference"), 17)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(18))
    tokens = model.generate(prompt, 8, temperature=0)
    with plain_chain():
        assert torch.equal(tokens, model.generate(prompt, 8, temperature=0))
    assert len(set(tokens[0, 5:].tolist())) > 2  # not degenerate
    with torch.no_grad():
        logits = model(tokens)
        with plain_chain():
            assert torch.equal(logits, model(tokens))


def test_autocast_promotes_a_low_precision_branch_onto_the_fp32_stream():
    """Under autocast the branch outputs are bf16 while the stream (the embeddings) stays fp32:
    the adds the fused norm cannot take run as torch's promoting add, as in the plain chain."""
    model = randomize(GPT(small_config(), use_reference=True), 19).eval()
    idx = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(20))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)
        with plain_chain():
            assert torch.equal(logits, model(idx))
        layer = model.layers[0]
        h = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(21))
        out, residual = layer(h.bfloat16(), residual=h.cos(), return_residual=True)
        assert (out.dtype, residual.dtype) == (torch.bfloat16, torch.float32)
        assert torch.equal(residual + out, layer(h.cos() + h.bfloat16()))


@pytest.mark.parametrize("norm_class", [LayerNorm, RMSNorm])
def test_norm_modules_add_the_residual(path, norm_class):
    norm = randomize(norm_class(HIDDEN, use_reference=path == "reference"), 22)
    x, r = torch.randn(2, 3, 2, HIDDEN, generator=torch.Generator().manual_seed(23)).unbind(0)
    y, total = norm(x, residual=r)
    assert torch.equal(total, r + x)
    assert torch.equal(y, norm(r + x))


def test_multihead_attention_and_layernorm_linear_add_the_residual(path):
    """The sum comes last, after the bias (`return_bias`) and the normalized input
    (`return_layernorm_output`); cross-attention adds it into its query's norm."""
    reference = path == "reference"
    g = torch.Generator().manual_seed(24)
    x, r, encoder = (torch.randn(5, 2, HIDDEN, generator=g) for _ in range(3))
    linear = randomize(
        LayerNormLinear(HIDDEN, 16, return_bias=True, return_layernorm_output=True,
                        use_reference=reference), 25,
    )  # fmt: skip
    out, bias, ln_out, total = linear(x, residual=r)
    assert torch.equal(total, r + x)
    for got, expected in zip((out, bias, ln_out), linear(r + x)):
        assert torch.equal(got, expected)
    for attention_type, extra in (("self", {}), ("cross", dict(encoder_output=encoder))):
        attention = randomize(
            MultiheadAttention(
                HIDDEN, HEADS, attention_dropout=0.0, input_layernorm=True,
                attention_type=attention_type, return_layernorm_output=True,
                use_reference=reference,
            ), 26,
        )  # fmt: skip
        out, ln_out, total = attention(x, residual=r, **extra)
        assert torch.equal(total, r + x)
        for got, expected in zip((out, ln_out), attention(r + x, **extra)):
            assert torch.equal(got, expected)


def test_errors_name_the_argument():
    x = torch.randn(5, 2, HIDDEN)
    wrong = {
        "shape": (torch.randn(5, 2, HIDDEN + 1), r"\(5, 2, 33\)"),
        "dtype": (x.half(), "torch.float16"),
        "device": (torch.empty(5, 2, HIDDEN, device="meta"), "meta"),
    }
    modules = {
        "LayerNorm": LayerNorm(HIDDEN),
        "LayerNormLinear": LayerNormLinear(HIDDEN, 8),
        "MultiheadAttention": MultiheadAttention(HIDDEN, HEADS, input_layernorm=True),
        "TransformerLayer": TransformerLayer(HIDDEN, FFN, HEADS),
    }
    for module_name, module in modules.items():
        for what, (residual, shown) in wrong.items():
            if module_name == "TransformerLayer" and what == "dtype":
                continue  # promoted (the autocast case), see the autocast test
            with pytest.raises(ValueError, match=rf"residual \(.*{shown}.*must match"):
                module(x, residual=residual)
    r = torch.randn_like(x)
    with pytest.raises(ValueError, match=r"residual \(\(5, 2, 32\), .*input_layernorm=False"):
        MultiheadAttention(HIDDEN, HEADS)(x, residual=r)
    with pytest.raises(ValueError, match=r"input_layernorm=False"):
        MultiheadAttention(HIDDEN, HEADS, attention_type="cross")(x, encoder_output=x, residual=r)
    for flag in ("output_layernorm", "apply_residual_connection_post_layernorm"):
        layer = TransformerLayer(HIDDEN, FFN, HEADS, **{flag: True})
        assert not layer.supports_residual_stream
        for kwargs in (dict(residual=r), dict(return_residual=True)):
            with pytest.raises(ValueError, match=rf"pre-LN TransformerLayer.*{flag}=True"):
                layer(x, **kwargs)
