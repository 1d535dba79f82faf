"""transformers models on attn_implementation="fusedlayers", in bf16 on CUDA: the Triton kernels.

The checks of tests/test_transformers_integration.py on the GPU: tiny random models of each
family (tests/transformers_testing.py) against the same weights on transformers' sdpa (eager
where the family has none) in bf16, by the 2x rule against an fp32 eager model; greedy generation
on left-padded prompts (dynamic, sliding and static caches), where a first difference must be a
near tie under the fp32 model; a training step on a right-padded batch; packed sequences.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import transformers_testing as tt  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16
ATOL = 2e-3  # on top of 2x the bf16 comparator's error (relative for gradients)
TIE = 0.1  # fp32 logit gap under which bf16 kernels may break a tie either way
LENGTHS = (9, 6, 3)


def _variants(model, comparator, names=(tt.NAME,)):
    return (
        tt.variant(model, tt.ORACLE, torch.float32, "cuda"),
        tt.variant(model, comparator, DTYPE, "cuda"),
        *(tt.variant(model, name, DTYPE, "cuda") for name in names),
    )


@pytest.mark.parametrize("family", sorted(tt.FAMILIES))
def test_logits_and_gradients_left_padded_bf16(family, monkeypatch):
    spy = tt.RouteSpy(monkeypatch)
    model, comparator = tt.tiny_model(family)
    ids, mask = tt.padded_batch(LENGTHS, 9, "left", device="cuda")
    oracle, compared, got = (
        tt.forward_backward(m, ids, mask) for m in _variants(model, comparator)
    )
    tt.assert_two_x(got[0], compared[0], oracle[0], f"{family} logits", ATOL)
    tt.assert_grads_two_x(got[2], compared[2], oracle[2], ATOL)
    assert spy.saw("left padding")
    if family == "gpt_oss":  # sinks on the kernels, through their differentiable LSE
        assert all(route.endswith("+ sinks") for route in spy.routes), spy.routes


@pytest.mark.parametrize("family", sorted(tt.FAMILIES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_left_padded_bf16(family, cache, monkeypatch):
    spy = tt.RouteSpy(monkeypatch)
    model, comparator = tt.tiny_model(family)
    ids, mask = tt.padded_batch(LENGTHS, 9, "left", seed=2, device="cuda")
    oracle, compared, fused = _variants(model, comparator)
    kw = dict(cache_implementation="static") if cache == "static" else {}
    want = tt.greedy(compared, ids, mask, 8, **kw)
    got = tt.greedy(fused, ids, mask, 8, **kw)
    tt.assert_same_greedy(got, want, oracle, ids, mask, TIE)
    assert spy.saw("decode: flash_attn_with_kvcache"), spy.routes


@pytest.mark.parametrize("dynamic", [False, None], ids=["static-shapes", "automatic-dynamic"])
def test_static_cache_generate_compiles_no_more_than_sdpa(dynamic):
    """Static-cache generate compiles the decode step (inductor, CUDA graphs); over seven steps
    on left-padded prompts fusedlayers compiles no more graphs than sdpa, with no graph break:
    the keys used and the left padding, which change every step, reach the compiled step as
    device tensors of fixed shapes (as host ints they made every step compile and record anew).
    dynamic=False was generate's default in earlier transformers releases, None is now."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model, comparator = tt.tiny_model("llama")
    ids, mask = tt.padded_batch(LENGTHS, 9, "left", seed=7, device="cuda")
    oracle, compared, fused = _variants(model, comparator)

    def compiled_greedy(m):
        torch._dynamo.reset()
        counters.clear()
        config = CompileConfig(dynamic=dynamic)
        tokens = tt.greedy(m, ids, mask, 8, compile_config=config, cache_implementation="static")
        return tokens, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    want, want_graphs, want_breaks = compiled_greedy(compared)
    got, graphs, breaks = compiled_greedy(fused)
    assert want_graphs > 0, "generate compiled nothing"
    assert graphs <= want_graphs and breaks <= want_breaks, (
        f"fusedlayers: {graphs} graphs, {breaks} breaks; sdpa: {want_graphs}, {want_breaks}"
    )
    tt.assert_same_greedy(got, want, oracle, ids, mask, TIE)


@pytest.mark.parametrize("family", sorted(tt.FAMILIES))
def test_training_step_right_padded_bf16(family):
    model, comparator = tt.tiny_model(family)
    ids, mask = tt.padded_batch((9, 7, 4), 9, "right", seed=4, device="cuda")
    results = []
    for m in _variants(model, comparator):
        m.train()
        labels = tt.labels_of(ids, mask)
        loss = m(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.5).step()
        after = m(ids, attention_mask=mask, labels=labels).loss
        params = torch.cat([p.detach().double().flatten() for p in m.parameters()])
        results.append((loss.double(), after.double(), params))
    oracle, compared, got = results
    for i, what in enumerate(("loss", "loss after the step", "parameters after the step")):
        tt.assert_two_x(got[i], compared[i], oracle[i], f"{family} {what}", ATOL)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_packed_sequences_bf16(family, monkeypatch):
    spy = tt.RouteSpy(monkeypatch)
    model, comparator = tt.tiny_model(family)
    ids = torch.randint(1, 100, (1, 14), generator=torch.Generator().manual_seed(5)).cuda()
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]], device="cuda")
    with torch.no_grad():
        oracle, compared, got = (
            m(ids, position_ids=positions, use_cache=False).logits
            for m in _variants(model, comparator)
        )
    tt.assert_two_x(got, compared, oracle, f"{family} packed logits", ATOL)
    assert spy.saw("packed")


def test_static_cache_generate_on_split_decode_twice():
    """Static-cache generate compiles the model's step into CUDA graphs; prompts of 600 tokens
    give caches long enough for the decode kernel to split the keys (its partials are scratch).
    Two calls in a row, each against sdpa's tokens, with no more graphs and graph breaks than
    sdpa's (the decode step is not compiled again for each step's length): a
    device buffer the decode kept between calls once failed the graphs' memory-pool check on
    the second call, and a capture query broke the graph in `flash_attn_with_kvcache`."""
    from fusedlayers.kernels import _flash_decode
    from torch._dynamo.utils import counters

    model, comparator = tt.tiny_model("llama")
    ids, mask = tt.padded_batch((600, 400, 200), 600, "left", seed=6, device="cuda")
    oracle, compared, fused = _variants(model, comparator)

    def generate_twice(m):
        torch._dynamo.reset()
        counters.clear()
        runs = [tt.greedy(m, ids, mask, 8, cache_implementation="static") for _ in range(2)]
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0, "generate compiled nothing"
        return runs, graphs, sum(counters["graph_break"].values())

    (want, _), want_graphs, want_breaks = generate_twice(compared)
    _flash_decode._PLANS.clear()
    (got, again), graphs, breaks = generate_twice(fused)
    assert any(plan.num_splits > 1 for plan in _flash_decode._PLANS.values()), "no split decode"
    assert torch.equal(again, got)
    tt.assert_same_greedy(got, want, oracle, ids, mask, TIE)
    assert graphs <= want_graphs and breaks <= want_breaks, (
        f"fusedlayers: {graphs} graphs, {breaks} breaks; sdpa: {want_graphs}, {want_breaks}"
    )
