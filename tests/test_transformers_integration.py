"""transformers models on attn_implementation="fusedlayers" (fusedlayers.integrations.transformers).

Tiny random models of five families (tests/transformers_testing.py) against the same weights on
transformers' sdpa (eager where the family has no sdpa), by flash-attn's 2x rule against an fp64
eager model: logits and loss gradients on a left-padded batch, greedy generation on left-padded
prompts of different lengths (dynamic, sliding-window and static caches), a training step on a
right-padded batch. On CPU tensors the registered "fusedlayers" takes the reference path; the
"fusedlayers-kernel" registration (backend="kernel") runs the Triton kernels under the
interpreter (TRITON_INTERPRET=1, tests/conftest.py) in a few cases, so the mapping onto the
kernels (varlen, windows, softcap, GQA, the decode kernel) is checked on the CPU too.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformers_testing as tt  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    chunked_causal_mask_function,
    sdpa_mask,
)

from fusedlayers.errors import ArgumentError  # noqa: E402
from fusedlayers.integrations import _transformers_masks as masks  # noqa: E402
from fusedlayers.integrations import transformers as fl_hf  # noqa: E402

FP32_ATOL = 2e-5  # on top of 2x the fp32 comparator's own error (relative for gradients)
LENGTHS = (9, 6, 3)  # prompts of different lengths, two of them longer than the window (4)


def test_importing_fusedlayers_never_imports_transformers():
    code = (
        "import sys, fusedlayers, fusedlayers.integrations.transformers;"
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mask_recognition_agrees_with_sdpa_mask(monkeypatch):
    assert masks.check_recognition() == ""
    # The check catches a window convention off by one (what FA2's (w - 1, w - 1) would be).
    wrong = lambda causal, w, bidirectional_exact=True: (  # noqa: E731
        (-1, 0) if w is None and causal else (-1, -1) if w is None else (w, 0) if causal else (w, w)
    )
    monkeypatch.setattr(masks, "flash_window", wrong)
    assert "Pattern" in masks.check_recognition()


def test_static_cache_layout_keeps_what_moves_on_the_device():
    """A static cache passes q_offset as a tensor: the layout then holds kv_used and the left
    padding as int32 device tensors too, which its decode route reads instead of host ints."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    pattern = masks.Pattern(True, None, None)
    layout = masks.build_layout(pattern, 2, 1, 10, torch.tensor(6), 0, mask)
    assert (layout.form, layout.kv_used, layout.has_past) == ("left", 7, True)
    assert layout.seqlens.dtype == layout.left_pads.dtype == torch.int32
    assert layout.seqlens.tolist() == [7, 7] and layout.left_pads.tolist() == [2, 0]
    prefill = masks.build_layout(pattern, 2, 7, 10, torch.tensor(0), 0, mask)
    assert not prefill.has_past and prefill.seqlens.tolist() == [7, 7]
    dynamic = masks.build_layout(pattern, 2, 1, 7, 6, 0, mask)  # an int offset: host values
    assert dynamic.seqlens is None and dynamic.left_pads.tolist() == [2, 0]


def test_unrecognized_mask_function_is_served_dense():
    fn = chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    args = dict(batch_size=2, q_length=6, kv_length=6, mask_function=fn, attention_mask=mask)
    got = fl_hf.mask_interface(**args)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bool
    assert torch.equal(got, sdpa_mask(**args, allow_is_causal_skip=False))


@pytest.mark.parametrize("family", sorted(tt.FAMILIES))
def test_logits_and_gradients_left_padded(family):
    model, comparator = tt.tiny_model(family)
    ids, mask = tt.padded_batch(LENGTHS, 9, "left")
    oracle = tt.forward_backward(tt.variant(model, tt.ORACLE, torch.float64), ids, mask)
    compared = tt.forward_backward(tt.variant(model, comparator, torch.float32), ids, mask)
    got = tt.forward_backward(tt.variant(model, tt.NAME, torch.float32), ids, mask)
    tt.assert_two_x(got[0], compared[0], oracle[0], f"{family} logits", FP32_ATOL)
    tt.assert_two_x(got[1], compared[1], oracle[1], f"{family} loss", FP32_ATOL)
    tt.assert_grads_two_x(got[2], compared[2], oracle[2], FP32_ATOL)


@pytest.mark.parametrize("family", sorted(tt.FAMILIES))
def test_greedy_generate_left_padded(family, monkeypatch):
    spy = tt.RouteSpy(monkeypatch)
    model, comparator = tt.tiny_model(family)
    ids, mask = tt.padded_batch(LENGTHS, 9, "left", seed=2)
    want = tt.greedy(tt.variant(model, comparator, torch.float32), ids, mask, 6)
    got = tt.greedy(tt.variant(model, tt.NAME, torch.float32), ids, mask, 6)
    tt.assert_same_greedy(got, want, tt.variant(model, tt.ORACLE, torch.float64), ids, mask, 1e-4)
    assert spy.saw("left padding")  # prefill and decode steps over the left padding


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_generate_static_cache(family, monkeypatch):
    spy = tt.RouteSpy(monkeypatch)
    model, comparator = tt.tiny_model(family)
    ids, mask = tt.padded_batch(LENGTHS, 9, "left", seed=3)
    kw = dict(cache_implementation="static")
    want = tt.greedy(tt.variant(model, comparator, torch.float32), ids, mask, 5, **kw)
    got = tt.greedy(tt.variant(model, tt.NAME, torch.float32), ids, mask, 5, **kw)
    tt.assert_same_greedy(got, want, tt.variant(model, tt.ORACLE, torch.float64), ids, mask, 1e-4)
    assert spy.routes


@pytest.mark.parametrize("family", sorted(tt.FAMILIES))
def test_training_step_right_padded(family):
    model, comparator = tt.tiny_model(family)
    ids, mask = tt.padded_batch((9, 7, 4), 9, "right", seed=4)
    results = {}
    for impl, dtype in ((tt.ORACLE, torch.float64), (comparator, torch.float32), (tt.NAME, None)):
        m = tt.variant(model, impl, dtype or torch.float32).train()
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        first = m(ids, attention_mask=mask, labels=tt.labels_of(ids, mask)).loss
        first.backward()
        optimizer.step()
        second = m(ids, attention_mask=mask, labels=tt.labels_of(ids, mask)).loss
        params = torch.cat([p.detach().double().flatten() for p in m.parameters()])
        results[impl if dtype else "fused"] = (first.double(), second.double(), params)
    oracle, compared, got = results[tt.ORACLE], results[comparator], results["fused"]
    for i, what in enumerate(("loss", "loss after the step", "parameters after the step")):
        tt.assert_two_x(got[i], compared[i], oracle[i], f"{family} {what}", FP32_ATOL)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_sequences_from_position_ids(family, monkeypatch):
    """Sequences packed in one row, told apart by restarting position ids (no mask)."""
    spy = tt.RouteSpy(monkeypatch)
    model, comparator = tt.tiny_model(family)
    ids = torch.randint(1, 100, (1, 14), generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]])
    outs = {}
    for impl, dtype in ((tt.ORACLE, torch.float64), (comparator, torch.float32), (tt.NAME, None)):
        m = tt.variant(model, impl, dtype or torch.float32)
        with torch.no_grad():
            logits = m(ids, position_ids=positions, use_cache=False).logits
            outs[impl if dtype else "fused"] = logits
    tt.assert_two_x(outs["fused"], outs[comparator], outs[tt.ORACLE], "packed logits", FP32_ATOL)
    assert spy.saw("packed")


def test_user_4d_mask_and_attention_weights():
    """A 4-D mask of the user's own (served dense) and output_attentions (the weights)."""
    model, _ = tt.tiny_model("llama")
    ids, mask = tt.padded_batch((8, 8), 8, "left", seed=6)
    allowed = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(7)) > 0.3
    allowed |= torch.eye(8, dtype=torch.bool)  # every query sees itself
    outs = {}
    for impl, dtype in ((tt.ORACLE, torch.float64), ("sdpa", torch.float32), (tt.NAME, None)):
        m = tt.variant(model, impl, dtype or torch.float32)
        with torch.no_grad():
            four_d = allowed if impl != tt.ORACLE else torch.zeros(2, 1, 8, 8, dtype=dtype)
            if impl == tt.ORACLE:
                four_d = four_d.masked_fill(~allowed, torch.finfo(dtype).min)
            logits = m(ids, attention_mask=four_d).logits
            weights = m(ids, attention_mask=mask, output_attentions=True).attentions
        outs[impl if dtype else "fused"] = (logits, weights)
    tt.assert_two_x(outs["fused"][0], outs["sdpa"][0], outs[tt.ORACLE][0], "4-D mask", FP32_ATOL)
    for got, want in zip(outs["fused"][1], outs[tt.ORACLE][1]):
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)


def _sink_eager(q, k, v, sinks, scale, visible):
    """gpt-oss's eager attention in fp64: the sink is an extra logit per head."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return (probs @ v).transpose(1, 2)


# Padding per sequence (1 = real token) for each mask form the adapter serves differently.
SINK_PADDING = {
    "none": [[1] * 7, [1] * 7],
    "left": [[1] * 7, [0, 0] + [1] * 5],
    "right": [[1] * 7, [1] * 5 + [0, 0]],
}
SINK_FORMS = [("left", False), ("right", False), ("none", False), ("left", True)]


@pytest.mark.parametrize("backend", ["reference", "kernel"])
@pytest.mark.parametrize("padding, dense", SINK_FORMS, ids=["left", "right", "none", "dense"])
def test_sinks_forward_and_gradients(padding, dense, backend, monkeypatch):
    """out * sigmoid(lse - s_aux) on every route, against gpt-oss's formula in fp64: the output
    and the gradients of q, k, v and the sinks (the kernels' through their differentiable LSE)."""
    spy = tt.RouteSpy(monkeypatch)
    torch.manual_seed(8)
    b, h, hg, s, d = 2, 4, 2, 7, 16
    q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for n in (h, hg, hg))
    sinks = torch.randn(h, requires_grad=True)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    real_tokens = torch.tensor(SINK_PADDING[padding], dtype=torch.bool)
    visible = causal & real_tokens[:, None, None, :]
    module = torch.nn.Module()
    module.is_causal = True
    pattern = masks.Pattern(True, None, None)
    layout = masks.build_layout(pattern, b, s, s, 0, 0, real_tokens)
    mask = visible if dense else layout
    got, _ = fl_hf.attention_forward(
        module, q, k, v, mask, scaling=0.3, s_aux=sinks, backend=backend
    )
    want = _sink_eager(q, k, v, sinks, 0.3, visible)
    real = real_tokens[:, :, None, None].expand_as(want)  # padding queries: unspecified
    grad_out = torch.randn_like(want)
    grads = torch.autograd.grad((got.double() * grad_out * real).sum(), (q, k, v, sinks))
    grads_want = torch.autograd.grad((want * grad_out * real).sum(), (q, k, v, sinks))
    torch.testing.assert_close(got.double()[real], want[real], atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, grads_want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-5)
    if not dense:
        assert spy.routes and spy.routes[-1].endswith("+ sinks"), spy.routes


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_sinks_on_packed_sequences(backend, monkeypatch):
    """Sequences packed in one row (restarting position ids, no mask): the thd route's LSE
    [h, t] comes back as [b, s, h] for the sinks, with gradients of q, k, v and the sinks."""
    spy = tt.RouteSpy(monkeypatch)
    torch.manual_seed(9)
    lengths = (4, 3, 5)
    b, h, hg, s, d = 1, 4, 2, sum(lengths), 16
    q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for n in (h, hg, hg))
    sinks = torch.randn(h, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in lengths]).view(1, s)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    visible = (segment[:, None] == segment[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    module = torch.nn.Module()
    module.is_causal = True
    got, _ = fl_hf.attention_forward(
        module, q, k, v, None, scaling=0.3, s_aux=sinks, backend=backend, position_ids=positions
    )
    want = _sink_eager(q, k, v, sinks, 0.3, visible.view(1, 1, s, s))
    grad_out = torch.randn_like(want)
    grads = torch.autograd.grad((got.double() * grad_out).sum(), (q, k, v, sinks))
    grads_want = torch.autograd.grad((want * grad_out).sum(), (q, k, v, sinks))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, grads_want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-5)
    assert spy.routes == ["packed: thd + sinks"], spy.routes


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_sinks_on_a_row_without_keys_give_zero(backend):
    """A query that sees no key outputs 0 with a sink, as gpt-oss's eager does (the sink takes
    the whole row), and its gradients stay finite: the kernels' LSE is -inf there, and the
    backward drops that row's LSE gradient. The other rows match gpt-oss's formula."""
    torch.manual_seed(3)
    b, h, hg, s, d = 1, 2, 1, 4, 16
    q, k, v = (torch.randn(b, n, s, d, requires_grad=True) for n in (h, hg, hg))
    sinks = torch.randn(h, requires_grad=True)
    visible = torch.ones(b, 1, s, s, dtype=torch.bool).tril()
    visible[..., 1, :] = False  # query 1 sees nothing
    got, _ = fl_hf.attention_forward(
        torch.nn.Module(), q, k, v, visible, scaling=0.3, s_aux=sinks, backend=backend
    )
    assert torch.equal(got[:, 1], torch.zeros_like(got[:, 1]))
    grads = torch.autograd.grad(got.sum(), (q, k, v, sinks))
    assert all(torch.isfinite(g).all() for g in grads)
    want = _sink_eager(q, k, v, sinks, 0.3, visible)  # the sink alone: row 1 is 0 there too
    grads_want = torch.autograd.grad(want.sum(), (q, k, v, sinks))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, grads_want):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "s_aux, message",
    [
        (torch.zeros(3), r"shape \(4,\).*float32 of shape \(3,\)"),
        (torch.zeros(4, dtype=torch.int64), r"shape \(4,\).*int64"),
        ([0.0] * 4, "must be a tensor"),
    ],
    ids=["shape", "dtype", "list"],
)
def test_bad_sinks_are_refused(s_aux, message):
    q = torch.randn(1, 4, 3, 16)
    k = torch.randn(1, 2, 3, 16)
    with pytest.raises(ArgumentError, match=message):
        fl_hf.attention_forward(torch.nn.Module(), q, k, k, None, s_aux=s_aux)


def test_unknown_tensor_keyword_is_refused():
    q = torch.randn(1, 4, 3, 16)
    k = torch.randn(1, 2, 3, 16)
    with pytest.raises(NotImplementedError, match="sinks"):
        fl_hf.attention_forward(torch.nn.Module(), q, k, k, None, sinks=torch.zeros(4))


def test_dropout_applies_in_training_only():
    model, _ = tt.tiny_model("llama")
    fused = tt.variant(model, tt.NAME, torch.float32)
    for layer in fused.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids, mask = tt.padded_batch((6, 4), 6, "right", seed=9)
    with torch.no_grad():
        evals = [fused(ids, attention_mask=mask).logits for _ in range(2)]
        fused.train()
        trains = [fused(ids, attention_mask=mask).logits for _ in range(2)]
    assert torch.equal(evals[0], evals[1])
    assert not torch.allclose(trains[0], trains[1])


# The Triton kernels under the interpreter: the same checks, fewer cases (it is slow).


@pytest.mark.parametrize(
    "family, side",
    [("llama", "left"), ("mistral", "right"), ("gemma2", "left"), ("gpt_oss", "right")],
)
def test_kernels_logits_and_gradients(family, side, monkeypatch):
    spy = tt.RouteSpy(monkeypatch)
    model, comparator = tt.tiny_model(family)
    ids, mask = tt.padded_batch((8, 5), 8, side, seed=10)
    oracle = tt.forward_backward(tt.variant(model, tt.ORACLE, torch.float64), ids, mask)
    compared = tt.forward_backward(tt.variant(model, comparator, torch.float32), ids, mask)
    got = tt.forward_backward(tt.variant(model, tt.KERNEL_NAME, torch.float32), ids, mask)
    tt.assert_two_x(got[0], compared[0], oracle[0], f"{family} logits (kernels)", FP32_ATOL)
    tt.assert_grads_two_x(got[2], compared[2], oracle[2], FP32_ATOL)
    assert spy.saw(f"{side} padding")
    if family == "gpt_oss":  # sinks through the kernels' differentiable LSE
        assert all(route.endswith("+ sinks") for route in spy.routes), spy.routes


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_kernels_generate_takes_the_decode_kernel(family, monkeypatch):
    spy = tt.RouteSpy(monkeypatch)
    model, comparator = tt.tiny_model(family)
    ids, mask = tt.padded_batch((7, 4), 7, "left", seed=11)
    want = tt.greedy(tt.variant(model, comparator, torch.float32), ids, mask, 4)
    got = tt.greedy(tt.variant(model, tt.KERNEL_NAME, torch.float32), ids, mask, 4)
    tt.assert_same_greedy(got, want, tt.variant(model, tt.ORACLE, torch.float64), ids, mask, 1e-4)
    assert spy.saw("decode: flash_attn_with_kvcache")


@pytest.mark.parametrize("dynamic", [False, None], ids=["static-shapes", "automatic-dynamic"])
def test_kernels_static_cache_generate_compiles_whole(dynamic):
    """generate with a static cache compiles the decode steps (on a GPU by itself; here
    `_compile_all_devices`). With fullgraph=True a graph break anywhere raises, so the steps run
    on the decode kernel's custom op with no break in the attention function. Over seven decode
    steps it compiles as many graphs as sdpa, one: the keys used and the left padding change
    every step and reach the compiled step as device tensors of fixed shapes, not as host ints
    or shapes it would be specialized on (with dynamic=False, generate's default in earlier
    releases, each step compiled again). The tokens match sdpa's. (The graphs' ops are read
    from the backend: a RouteSpy's growing list would itself make each step compile again.)"""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model, comparator = tt.tiny_model("llama")
    ids, mask = tt.padded_batch((7, 4), 7, "left", seed=12)
    ops = set()

    def backend(gm, example_inputs):
        ops.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    def compiled_greedy(implementation):
        config = CompileConfig(fullgraph=True, dynamic=dynamic, backend=backend, mode=None)
        config._compile_all_devices = True
        torch._dynamo.reset()
        counters.clear()
        m = tt.variant(model, implementation, torch.float32)
        tokens = tt.greedy(m, ids, mask, 8, compile_config=config, cache_implementation="static")
        return tokens, counters["stats"]["unique_graphs"]

    want, want_graphs = compiled_greedy(comparator)
    ops.clear()
    got, graphs = compiled_greedy(tt.KERNEL_NAME)
    assert want_graphs == 1  # the steps were compiled, once
    assert graphs == want_graphs, f"{graphs} graphs over the decode steps, sdpa {want_graphs}"
    assert "fusedlayers.decode_attention.default" in ops, sorted(ops)
    tt.assert_same_greedy(got, want, tt.variant(model, tt.ORACLE, torch.float64), ids, mask, 1e-4)


def test_kernels_packed_sequences(monkeypatch):
    spy = tt.RouteSpy(monkeypatch)
    model, _ = tt.tiny_model("qwen2")
    ids = torch.randint(1, 100, (1, 10), generator=torch.Generator().manual_seed(12))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    outs = {}
    for impl, dtype in (
        (tt.ORACLE, torch.float64),
        ("sdpa", torch.float32),
        (tt.KERNEL_NAME, None),
    ):
        with torch.no_grad():
            m = tt.variant(model, impl, dtype or torch.float32)
            logits = m(ids, position_ids=positions, use_cache=False).logits
            outs[impl if dtype else "fused"] = logits
    tt.assert_two_x(outs["fused"], outs["sdpa"], outs[tt.ORACLE], "packed (kernels)", FP32_ATOL)
    assert spy.saw("packed")
