"""`flash_attn_with_kvcache` on the CPU interpreter (fp16/fp32, small shapes).

Each case checks the cache after the append (the rows that must change and every byte that must
not) and out/LSE against an fp64 oracle (tests/kvcache_testing.py). Then: paged against
contiguous, split counts against each other, rows with no key, the split heuristic, the two ways
of merging splits (in the main launch's last program per tile, or a second launch), and every bad
input raising before any write.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import numpy as np
import pytest
import torch
from fusedlayers.kernels import _compat, _decode_merge, _flash_decode, rotate_and_append
from kvcache_testing import (
    COMBINES,
    KVCase,
    call_kernel,
    check_kv_case,
    make_kv_inputs,
    pin_combine,
    tickets_all_zero,
)

from fusedlayers import flash_attn_with_kvcache
from fusedlayers.attention import kvcache

F16, F32 = torch.float16, torch.float32
CAUSAL = (-1, 0)

CASES = [
    KVCase(),  # plain decode, GQA 4:2, heuristic splits
    KVCase(dtype=F32, h=4, hk=4, num_splits=1),  # MHA, no combine pass
    KVCase(h=6, hk=1, s_q=3, s_new=3, causal=True),  # MQA, append + causal, s_q > 1
    KVCase(s_q=2, s_new=2, causal=False, num_splits=3),  # non-causal s_q > 1
    KVCase(page_size=16, s_new=1, causal=True),  # paged append
    KVCase(dtype=F32, page_size=32, s_q=2, s_new=2, causal=True, leftpad=True, b=3),
    KVCase(batch_idx=True, s_new=2, s_q=2, causal=True),
    KVCase(leftpad=True, s_new=1, b=3, num_splits=2),
    KVCase(s_q=3, s_new=3, window=(5, 0), num_splits=2),  # sliding window (local)
    KVCase(s_q=2, window=(7, 1), causal=False),
    KVCase(softcap=2.0, s_new=1, causal=True),
    KVCase(dtype=F32, alibi=True, s_q=2, s_new=2, causal=True, num_splits=3),
    KVCase(rotary="interleaved", s_new=2, s_q=2, causal=True),
    KVCase(rotary="half", s_new=1, s_q=2, causal=False),  # every query at position cache_seqlens
    KVCase(dtype=F32, rotary="half", rotary_dim=8, s_new=2, s_q=2, window=(6, -1)),  # partial
    KVCase(seqlens="zero", s_new=2, s_q=2, causal=True),  # empty prefix
    KVCase(d=40, s_new=1, page_size=16, causal=True),  # padded head dim, paged
    KVCase(page_size=16, s_new=2, s_q=2, b=3, causal=True, rotary="half"),  # rotated into pages
    KVCase(batch_idx=True, s_new=1, causal=True, rotary="interleaved"),  # into other entries
    KVCase(h=6, hk=2, d=40, s_new=3, s_q=1, causal=True, rotary="half"),  # s_new > s_q, padded d
]


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_matches_reference(case, combine, monkeypatch):
    pin_combine(monkeypatch, combine)
    check_kv_case(case, "cpu")


def _compiled_call(case: KVCase, inputs: dict):
    """`call_kernel` traced whole by torch.compile (fullgraph: no graph break)."""

    def step(**tensors):
        return call_kernel(case, tensors)

    torch._dynamo.reset()
    return torch.compile(step, fullgraph=True, backend="aot_eager")(**inputs)


# The decode entries are custom ops under torch.compile (kernels/decode_ops.py): tracing the
# launchers broke on their host reads and, on a GPU, on CUDA-graphed module buffers
# (transformers' static-cache generate). Plain decode; paged append with left padding; rotary
# into pages.
@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[17]], ids=lambda c: c.label())
def test_compiled_call_matches_reference(case):
    check_kv_case(case, "cpu", call=_compiled_call)


def test_append_never_writes_past_the_capacity():
    """The fused append leaves rows at or past the cache's capacity alone, even when a caller
    (a CUDA graph replayed once too often) asks for them: the cache is a view into a larger
    buffer, so a write past its end would land in the rows checked here."""
    b, hk, d, capacity, s_new = 2, 2, 16, 8, 3
    buffer = torch.randn(b, capacity + 4, hk, d)
    k_cache, v_cache = buffer[:, :capacity], buffer.clone()[:, :capacity]
    q = torch.randn(b, 1, 4, d)
    k, v = torch.randn(b, s_new, hk, d), torch.randn(b, s_new, hk, d)
    seqlens = torch.tensor([capacity - 1, capacity - 3], dtype=torch.int32)
    beyond = buffer[:, capacity:].clone()
    _, after = rotate_and_append(
        q, k, v, k_cache, v_cache, seqlens, rotary_q=None, rotary_k=None, local=True,
        interleaved=False,
    )  # fmt: skip
    assert after.tolist() == [capacity + 2, capacity]
    torch.testing.assert_close(k_cache[0, capacity - 1], k[0, 0], rtol=0, atol=0)
    torch.testing.assert_close(k_cache[1, capacity - 3 :], k[1], rtol=0, atol=0)
    torch.testing.assert_close(buffer[:, capacity:], beyond, rtol=0, atol=0)


def test_paged_matches_contiguous():
    common = dict(s_q=2, s_new=2, causal=True, alibi=True, dtype=F32)
    flat, paged = KVCase(**common), KVCase(**common, page_size=16)
    flat_inputs, paged_inputs = make_kv_inputs(flat, "cpu"), make_kv_inputs(paged, "cpu")
    paged_inputs["alibi_slopes"] = flat_inputs["alibi_slopes"]  # drawn after the pages
    out_flat, lse_flat = call_kernel(flat, flat_inputs)
    out_paged, lse_paged = call_kernel(paged, paged_inputs)
    torch.testing.assert_close(out_paged, out_flat, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_paged, lse_flat, rtol=1e-6, atol=1e-6)


def test_split_counts_agree():
    case = KVCase(dtype=F32, s_q=2, causal=True, s_cache=96, window=(50, 0))
    results = [call_kernel(case, make_kv_inputs(case, "cpu"), num_splits=n) for n in (1, 2, 5, 0)]
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=1e-5, atol=1e-5)


def test_several_row_blocks(monkeypatch):
    # 6 query heads per KV head x 3 queries = 18 packed rows, over tiles of 16 rows.
    monkeypatch.setattr(_flash_decode, "MAX_BLOCK_M", 16)
    check_kv_case(KVCase(h=6, hk=1, s_q=3, s_new=3, causal=True, num_splits=2), "cpu")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_no_visible_key_gives_zero_and_minus_inf(num_splits):
    case = KVCase(seqlens="zero", num_splits=num_splits)
    out, lse = call_kernel(case, make_kv_inputs(case, "cpu"))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_calls_of_one_check_key_share_the_entry_plan_and_stay_exact(monkeypatch):
    """`flash_attn_with_kvcache` hands its check key to the kernel entry as its launch signature:
    calls that share the key (what is outside it: the rotary layout, the LSE's return, an int
    length's value) share one decode plan, and each still matches the fp64 oracle."""
    monkeypatch.setattr(_flash_decode, "_PLANS", {})
    common = dict(s_q=2, s_new=2, causal=True, num_splits=3)
    for case in (
        KVCase(rotary="interleaved", **common),
        KVCase(rotary="half", **common),
        KVCase(rotary="half", seed=1, **common),
    ):
        check_kv_case(case, "cpu")
    assert len(_flash_decode._PLANS) == 1
    ((signature, *_),) = _flash_decode._PLANS
    assert signature[0] == "flash_attn_with_kvcache"
    # int lengths: one key whatever the value
    case = KVCase(dtype=F32, seqlens="full", s_new=1, num_splits=2)
    for length in (case.s_cache - 1, 5):
        inputs = make_kv_inputs(case, "cpu")
        out = call_kernel(case, inputs, cache_seqlens=length, return_softmax_lse=False)
        tensor_lengths = torch.full((case.b,), length, dtype=torch.int32)
        want, _ = call_kernel(case, make_kv_inputs(case, "cpu"), cache_seqlens=tensor_lengths)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert len(_flash_decode._PLANS) == 3  # the int key and the tensor one


def test_int_and_none_cache_seqlens_and_lse_off():
    case = KVCase(dtype=F32, seqlens="full", s_new=1)
    inputs = make_kv_inputs(case, "cpu")
    out_tensor, _ = call_kernel(case, make_kv_inputs(case, "cpu"))
    out = call_kernel(case, inputs, cache_seqlens=case.s_cache - 1, return_softmax_lse=False)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, out_tensor, rtol=0, atol=0)
    # None: every sequence fills the whole cache (here after the append above).
    out_none = call_kernel(case, inputs, k=None, v=None, cache_seqlens=None)[0]
    out_full = call_kernel(case, inputs, k=None, v=None, cache_seqlens=case.s_cache)[0]
    torch.testing.assert_close(out_none, out_full, rtol=0, atol=0)


def test_signature_is_flash_attn_28():
    params = inspect.signature(flash_attn_with_kvcache).parameters
    assert list(params) == [
        "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
        "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
        "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
        "return_softmax_lse",
    ]  # fmt: skip
    defaults = {n: p.default for n, p in params.items() if n not in ("q", "k_cache", "v_cache")}
    assert defaults == dict(
        k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
        cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
        causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
        alibi_slopes=None, num_splits=0, return_softmax_lse=False,
    )  # fmt: skip


def test_strided_index_tensors():
    case = KVCase(page_size=16, s_new=1, causal=True, b=3, leftpad=True)
    inputs = make_kv_inputs(case, "cpu")
    out_dense, lse_dense = call_kernel(case, make_kv_inputs(case, "cpu"))
    # The same values through views with non-unit strides.
    inputs["block_table"] = inputs["block_table"].t().contiguous().t()
    inputs["cache_seqlens"] = torch.stack([inputs["cache_seqlens"]] * 2, dim=1)[:, 0]
    inputs["cache_leftpad"] = torch.stack([inputs["cache_leftpad"]] * 2, dim=1)[:, 1]
    assert inputs["block_table"].stride(1) != 1 and inputs["cache_seqlens"].stride(0) == 2
    out, lse = call_kernel(case, inputs)
    torch.testing.assert_close(out, out_dense, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_dense, rtol=0, atol=0)


def test_empty_batch():
    q = torch.randn(0, 1, 4, 16, dtype=F16)
    cache = torch.zeros(0, 8, 2, 16, dtype=F16)
    out, lse = flash_attn_with_kvcache(
        q, cache, cache.clone(), cache_seqlens=torch.zeros(0, dtype=torch.int32),
        return_softmax_lse=True,
    )  # fmt: skip
    assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1)


def test_debug_log_names_the_path(monkeypatch, caplog):
    monkeypatch.setenv("FUSEDLAYERS_DEBUG", "1")
    case = KVCase(page_size=16, s_new=1)
    with caplog.at_level("INFO", logger="fusedlayers"):
        call_kernel(case, make_kv_inputs(case, "cpu"))
    assert "split-KV decode kernel: paged, page_size 16" in caplog.text


def test_split_heuristic():
    cpu = torch.device("cpu")  # stands in for the H100: 132 multiprocessors
    assert _flash_decode.num_splits_heuristic(64 * 8, 32768, cpu) == 1  # enough programs
    assert _flash_decode.num_splits_heuristic(8, 131072, cpu) == 16  # one wave of 132
    assert _flash_decode.num_splits_heuristic(8, 256, cpu) == 2  # no split under 2 blocks
    assert _flash_decode.num_splits_heuristic(64, 8192, cpu) == 2  # 128 programs
    assert _flash_decode.num_splits_heuristic(12, 1280, cpu) == 10  # 20 blocks: 2 a split
    assert _flash_decode.num_splits_heuristic(1, 1 << 20, cpu) == _flash_decode.MAX_SPLITS


# --------------------------------------------------------------------------------------------------
# Merging the splits: in the main launch (fused, the last split program of each tile) or a second
# --------------------------------------------------------------------------------------------------

# Explicit split counts from 1 to MAX_SPLITS-like (one key block per split under the interpreter's
# 16-key blocks): random lengths, left pads and windows leave some split programs with no key.
SPLIT_CASES = [
    KVCase(num_splits=1),  # no merge at all
    KVCase(num_splits=2),  # GQA 4:2, every split full
    KVCase(page_size=16, s_new=1, causal=True, num_splits=4, b=3),  # paged, shuffled pages
    KVCase(dtype=F32, s_cache=256, num_splits=16, b=3, h=6, hk=2, s_q=2, s_new=2, causal=True),
    KVCase(dtype=F32, s_cache=128, page_size=32, num_splits=8, leftpad=True, b=3, s_new=1),
    KVCase(s_cache=96, num_splits=5, s_q=3, s_new=3, window=(20, 0)),  # 6 blocks over 5 splits
    KVCase(h=6, hk=1, s_q=3, s_new=3, causal=True, num_splits=3),  # MQA, 18 packed rows
    KVCase(dtype=F32, alibi=True, softcap=3.0, batch_idx=True, s_q=2, s_new=2, num_splits=3),
    KVCase(d=40, page_size=16, s_new=1, causal=True, num_splits=4, rotary="half"),  # padded d
    KVCase(seqlens="zero", s_q=2, num_splits=4),  # no key anywhere: out 0, LSE -inf
]


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.label())
def test_split_merge_matches_reference(case, combine, monkeypatch):
    """Either merge against the fp64 oracle (out and the returned LSE), twice in a row on fresh
    inputs of one signature: the fused merge leaves every ticket counter at 0 after each call,
    so the second call starts from zero too, and it launches no second kernel."""
    merges = pin_combine(monkeypatch, combine)
    for seed in (0, 1):
        check_kv_case(dataclasses.replace(case, seed=seed), "cpu")
        assert tickets_all_zero()
    split = case.num_splits > 1
    assert len(merges) == (2 if split and combine == "separate" else 0)


@pytest.mark.parametrize("max_block_m", [16, 64])
def test_fused_and_separate_merges_agree(monkeypatch, max_block_m):
    # 6 query heads per KV head x 3 queries = 18 packed rows: two row blocks (tiles) per KV head
    # with 16-row tiles, each with its own counter.
    monkeypatch.setattr(_flash_decode, "MAX_BLOCK_M", max_block_m)
    case = KVCase(dtype=F32, h=6, hk=2, s_q=3, s_cache=128, causal=True, num_splits=6, b=3,
                  leftpad=True)  # fmt: skip
    results = {}
    for combine in COMBINES:
        pin_combine(monkeypatch, combine)
        results[combine] = call_kernel(case, make_kv_inputs(case, "cpu"))
    for fused, separate in zip(results["fused"], results["separate"]):
        torch.testing.assert_close(fused, separate, rtol=1e-6, atol=1e-6)
    assert tickets_all_zero()


def test_merge_too_large_to_fuse_takes_the_second_launch(monkeypatch):
    """A merge whose partials exceed one load (`_COMBINE_ELEMENTS`) runs as the separate
    merge even with the fused one selected, and is exact; the counters stay untouched."""
    # 6 rows (3 query heads x 2 queries) of 5 splits, d = 16: 8 x 8 x 16 elements to load
    monkeypatch.setattr(_decode_merge, "_COMBINE_ELEMENTS", 64)
    monkeypatch.setattr(_flash_decode, "_PLANS", {})  # plans made under the setting above
    merges = pin_combine(monkeypatch, "fused")
    case = KVCase(h=6, hk=2, s_q=2, s_new=2, s_cache=96, causal=True, num_splits=5, b=3)
    check_kv_case(case, "cpu")
    (plan,) = _flash_decode._PLANS.values()
    assert plan.num_splits == 5 and plan.fused_constexprs is None
    assert merges and set(merges) == {"_decode_combine"}
    assert tickets_all_zero()


def test_fuses_merge_only_in_one_load():
    fuses = _decode_merge._fuses_merge
    budget = _decode_merge._COMBINE_ELEMENTS
    assert budget == 8192
    assert fuses(4, 16, 128)  # b = 1, GQA 32:8, 16 splits (the one-wave rule): one load
    assert not fuses(4, 64, 128)  # the paged two-wave rule's 33 splits
    assert fuses(1, 64, 128) and not fuses(1, 128, 128)  # MHA: one row a tile
    assert fuses(3, 16, 128) and not fuses(5, 16, 128)  # rows padded to a power of two


def test_ticket_counters_grow_and_keep_the_old_buffer(monkeypatch):
    monkeypatch.setattr(_decode_merge, "_TICKETS", {})
    monkeypatch.setattr(_decode_merge, "_RETIRED_TICKETS", [])
    monkeypatch.setattr(_decode_merge, "_MIN_TICKETS", 2)
    pin_combine(monkeypatch, "fused")
    small = KVCase(b=1, num_splits=3)  # 2 KV heads: 2 tiles
    check_kv_case(small, "cpu")
    first = _decode_merge._TICKETS[torch.device("cpu")]
    assert first.numel() == 2
    check_kv_case(KVCase(b=3, num_splits=3), "cpu")  # 6 tiles
    grown = _decode_merge._TICKETS[torch.device("cpu")]
    assert grown.numel() == 8 and _decode_merge._RETIRED_TICKETS == [first]
    check_kv_case(dataclasses.replace(small, seed=1), "cpu")  # fewer tiles: the same buffer
    assert _decode_merge._TICKETS[torch.device("cpu")] is grown
    assert tickets_all_zero()


def test_no_ticket_counters_means_the_separate_merge(monkeypatch):
    """Under CUDA graph capture a buffer too small is not grown (its zero-fill would only be
    recorded): the call merges in a second launch instead."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(_decode_merge, "_TICKETS", {})
    assert _decode_merge._ticket_counters(torch.device("cuda", 0), 4) is None
    assert _decode_merge._TICKETS == {}
    merges = pin_combine(monkeypatch, "fused")
    monkeypatch.setattr(_decode_merge, "_ticket_counters", lambda device, count: None)
    check_kv_case(KVCase(num_splits=3), "cpu")
    assert merges == ["_decode_combine"]


# --------------------------------------------------------------------------------------------------
# The per-device scratch: split partials and an unreturned lse (`_decode_merge._scratch`)
# --------------------------------------------------------------------------------------------------

# No split; a split call (merged either way: the tests pin the merge); s_q > 1 over two row
# blocks; paged with a left pad.
SCRATCH_CASES = [
    KVCase(num_splits=1, s_new=1, causal=True),
    KVCase(num_splits=3, s_q=2, s_new=2, causal=True),
    KVCase(h=6, hk=1, s_q=3, s_new=3, causal=True, num_splits=2),
    KVCase(page_size=16, leftpad=True, b=3, s_new=1, num_splits=4, causal=True),
]


@pytest.fixture
def fresh_scratch(monkeypatch):
    """An empty scratch table (the buffers made by other tests stay out of these ones)."""
    monkeypatch.setattr(_decode_merge, "_SCRATCH", {})
    monkeypatch.setattr(_decode_merge, "_RETIRED_SCRATCH", [])
    monkeypatch.setattr(_decode_merge, "_SCRATCH_VIEWS", {})


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("case", SCRATCH_CASES, ids=lambda c: c.label())
def test_out_without_lse_equals_out_with_it(case, combine, monkeypatch, fresh_scratch):
    """`return_softmax_lse=False` writes lse to the scratch instead of a returned tensor: out is
    bitwise the one of the call that returns lse (checked against the fp64 oracle), also when
    the scratch holds NaN from before (a stale partial read back would show)."""
    pin_combine(monkeypatch, combine)
    monkeypatch.setattr(_flash_decode, "MAX_BLOCK_M", 16)  # the 18-row case takes two blocks
    check_kv_case(case, "cpu")
    want, _ = call_kernel(case, make_kv_inputs(case, "cpu"))
    _decode_merge._scratch(torch.device("cpu"), 1).fill_(float("nan"))
    out = call_kernel(case, make_kv_inputs(case, "cpu"), return_softmax_lse=False)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert not _decode_merge._scratch(torch.device("cpu"), 1).isnan().all()
    assert tickets_all_zero()


def test_scratch_grows_and_keeps_the_old_buffer(monkeypatch, fresh_scratch):
    monkeypatch.setattr(_decode_merge, "_MIN_SCRATCH", 16)
    cpu = torch.device("cpu")
    small = KVCase(b=1, num_splits=3)  # partials: 4 heads x 3 splits x 16 + 12 lse = 204
    check_kv_case(small, "cpu")
    first = _decode_merge._SCRATCH[cpu]
    assert first.numel() == 256
    check_kv_case(KVCase(b=3, num_splits=3), "cpu")  # 612
    grown = _decode_merge._SCRATCH[cpu]
    assert grown.numel() == 1024 and _decode_merge._RETIRED_SCRATCH == [first]
    check_kv_case(dataclasses.replace(small, seed=1), "cpu")  # fits: the same buffer
    assert _decode_merge._SCRATCH[cpu] is grown
    # the first call's views (of the old buffer) were dropped when it grew: every view kept now
    # is of the grown buffer
    views = [view for kept in _decode_merge._SCRATCH_VIEWS.values() for view in kept]
    assert views and all(
        view.untyped_storage().data_ptr() == grown.untyped_storage().data_ptr() for view in views
    )


def test_unordered_streams_keep_no_buffers(monkeypatch, fresh_scratch):
    """`ORDERED_STREAMS = False`: each call allocates its own partials and lse and merges in a
    second launch, so nothing is shared between calls."""
    monkeypatch.setattr(_flash_decode, "ORDERED_STREAMS", False)
    monkeypatch.setattr(_decode_merge, "_TICKETS", {})
    merges = pin_combine(monkeypatch, "fused")
    case = KVCase(num_splits=3, s_new=1, causal=True)
    check_kv_case(case, "cpu")
    out = call_kernel(case, make_kv_inputs(case, "cpu"), return_softmax_lse=False)
    torch.testing.assert_close(
        out, call_kernel(case, make_kv_inputs(case, "cpu"))[0], rtol=0, atol=0
    )
    assert merges and set(merges) == {"_decode_combine"}
    assert _decode_merge._SCRATCH == {} and _decode_merge._TICKETS == {}


def test_compiled_split_call_keeps_no_buffers(monkeypatch, fresh_scratch):
    """Under torch.compile the decode op allocates its own partials and merges in a second
    launch: a buffer kept by the module would, inside the compiled step's CUDA graphs
    (transformers' static-cache generate), come from the graph's memory pool and fail its
    check that every live allocation is an output. Exact against the fp64 oracle."""
    monkeypatch.setattr(_decode_merge, "_TICKETS", {})
    merges = pin_combine(monkeypatch, "fused")
    check_kv_case(KVCase(num_splits=3, s_new=1, causal=True), "cpu", call=_compiled_call)
    assert merges and set(merges) == {"_decode_combine"}
    assert _decode_merge._SCRATCH == {} and _decode_merge._TICKETS == {}


def test_no_scratch_past_the_cap_or_under_capture(monkeypatch, fresh_scratch):
    """A call needing more than `_MAX_SCRATCH` elements allocates its own partials (and is
    exact); under CUDA graph capture a scratch too small is not grown."""
    monkeypatch.setattr(_decode_merge, "_MAX_SCRATCH", 64)
    assert _decode_merge._scratch(torch.device("cpu"), 65) is None
    check_kv_case(KVCase(num_splits=3), "cpu")  # 2 x 4 x 3 x 16 + 24 partials
    assert _decode_merge._SCRATCH == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert _decode_merge._scratch(torch.device("cuda", 0), 4) is None
    assert _decode_merge._SCRATCH == {}


# --------------------------------------------------------------------------------------------------
# Paged caches: each key block's page loaded one block ahead (`PAGE_PREFETCH`) or just before it
# --------------------------------------------------------------------------------------------------

# Shuffled pages of 4 or 2 interpreter key blocks (16 keys), split boundaries mid-page (the first
# case's longest sequence: 20 blocks over 3 splits, 7 a split), also after left pads and under a
# window. The longest sequence ends at its table row's end, so the one-ahead page load of its
# last block would read past the row.
PREFETCH_CASES = [
    KVCase(s_cache=320, page_size=64, num_splits=3, s_new=1, causal=True, b=3),
    KVCase(s_cache=320, page_size=64, num_splits=4, leftpad=True, b=3, s_q=2, s_new=2, causal=True),
    KVCase(dtype=F32, s_cache=192, page_size=32, num_splits=5, s_q=2, s_new=2, window=(40, 0)),
]


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
@pytest.mark.parametrize("case", PREFETCH_CASES, ids=lambda c: c.label())
def test_paged_prefetch_matches_reference(case, prefetch, monkeypatch):
    monkeypatch.setattr(_flash_decode, "PAGE_PREFETCH", prefetch)
    check_kv_case(case, "cpu")


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_paged_reads_only_the_pages_of_its_keys(prefetch, monkeypatch):
    """The block table is read at the entries of the pages holding each sequence's keys and
    nowhere else: the one-ahead page load stops at its split's end, and an empty split (one
    that starts past the keys, here past the longest row's last page) reads none. The table lies
    in a buffer with a guard after it, and every live load of the launch is checked (interpreter
    loads), so a read past the last row is seen too."""
    from triton.runtime import interpreter

    monkeypatch.setattr(_flash_decode, "PAGE_PREFETCH", prefetch)
    # 20 blocks of the longest sequence over 8 splits of 3: the last split starts at key 336.
    case = KVCase(b=3, s_cache=320, page_size=64, num_splits=8)
    inputs = make_kv_inputs(case, "cpu")
    # The longest sequence (`make_kv_inputs` puts it first) last: past its row lies the guard.
    for name in ("q", "cache_seqlens", "block_table"):
        inputs[name] = inputs[name].flip(0)
    inputs["lens"] = inputs["lens"][::-1]
    table = inputs["block_table"]
    buffer = torch.full((table.numel() + 64,), -1, dtype=torch.int32)
    inputs["block_table"] = buffer[: table.numel()].view_as(table).copy_(table)
    start, pages_per_row = buffer.data_ptr(), table.shape[1]
    builder = interpreter.interpreter_builder
    original = builder.create_masked_load
    read = set()

    def spy(ptrs, mask, *args):
        live = np.broadcast_to(mask.data, ptrs.data.shape)
        offsets = ptrs.data[live].astype(np.int64) - start
        for entry in offsets[(offsets >= 0) & (offsets < 4 * buffer.numel())] // 4:
            read.add(divmod(int(entry), pages_per_row))
        return original(ptrs, mask, *args)

    monkeypatch.setattr(builder, "create_masked_load", spy)
    call_kernel(case, inputs)
    pages = {(z, j) for z, n in enumerate(inputs["lens"]) for j in range(-(-n // case.page_size))}
    assert inputs["lens"][-1] == case.s_cache and read == pages


def test_page_prefetch_setting_has_plans_of_its_own(monkeypatch):
    """Toggling `PAGE_PREFETCH` between calls of one signature launches the kernel of the
    setting: each setting makes its own plan (constexprs, tuning keys, launch slots). Contiguous
    caches launch the one kernel either way."""
    monkeypatch.setattr(_flash_decode, "_PLANS", {})
    launched = []
    original = _flash_decode._launch

    def spy(grid, args, constexprs, *rest):
        launched.append((constexprs["PAGED"], constexprs["PAGE_PREFETCH"]))
        return original(grid, args, constexprs, *rest)

    monkeypatch.setattr(_flash_decode, "_launch", spy)
    paged = KVCase(s_cache=128, page_size=32, num_splits=3, s_new=1, causal=True)
    for prefetch in (True, False, True):
        monkeypatch.setattr(_flash_decode, "PAGE_PREFETCH", prefetch)
        check_kv_case(paged, "cpu")
        check_kv_case(dataclasses.replace(paged, page_size=None), "cpu")
    assert launched[0::2] == [(True, True), (True, False), (True, True)]
    assert set(launched[1::2]) == {(False, False)}
    plans = [plan for plan in _flash_decode._PLANS.values() if plan.constexprs["PAGED"]]
    assert len(plans) == 2 and len(_flash_decode._PLANS) == 4
    for key in ("tuning", "fused_tuning"):
        assert len({getattr(plan, key) for plan in plans}) == 2


# --------------------------------------------------------------------------------------------------
# Bad input: a clear exception before any write
# --------------------------------------------------------------------------------------------------

PAGED = KVCase(page_size=16, s_new=2, s_q=2, causal=True, rotary="interleaved")
FLAT = KVCase(s_new=2, s_q=2, causal=True, batch_idx=True, leftpad=True)


def _set(name, value):
    return lambda inputs: inputs.__setitem__(name, value(inputs))


def _table_entry(value):
    def edit(inputs):
        inputs["block_table"][0, 0] = value

    return edit


BAD = [
    (PAGED, _table_entry(10_000), ValueError, "block_table points outside"),
    (PAGED, _table_entry(-3), ValueError, "block_table points outside"),
    (PAGED, _set("cache_seqlens", lambda i: i["cache_seqlens"] + 63), ValueError, "overflows"),
    (PAGED, _set("cache_seqlens", lambda i: i["cache_seqlens"] - 100), ValueError, ">= 0"),
    (PAGED, _set("rotary_cos", lambda i: i["rotary_cos"][:10]), ValueError, "rotary_sin"),
    (PAGED, _set("rotary_cos", lambda i: i["rotary_cos"][:10].contiguous()), ValueError, "match"),
    (PAGED, _set("k_cache", lambda i: i["k_cache"][:, :8]), ValueError, "v_cache"),
    (PAGED, _set("cache_batch_idx", lambda i: i["cache_seqlens"] * 0), ValueError, "paged"),
    (PAGED, _set("block_table", lambda i: i["block_table"].long()), TypeError, "int32"),
    (FLAT, _set("cache_batch_idx", lambda i: i["cache_batch_idx"] + 10), ValueError, "[0, 4)"),
    (FLAT, _set("cache_leftpad", lambda i: i["cache_seqlens"] + 1), ValueError, "cache_leftpad"),
    (FLAT, _set("cache_seqlens", lambda i: i["cache_seqlens"].long()), TypeError, "int32"),
    (FLAT, _set("v", lambda i: None), ValueError, "together"),
    (FLAT, _set("k", lambda i: i["k"][:, :, :1]), ValueError, "s_new"),
    (FLAT, _set("k", lambda i: i["k"].float()), TypeError, "dtype"),
    (FLAT, _set("q", lambda i: i["q"][:, :, :3]), ValueError, "multiple"),
    (FLAT, _set("alibi_slopes", lambda i: torch.ones(3)), ValueError, "alibi_slopes"),
    (FLAT, _set("rotary_cos", lambda i: torch.ones(64, 8)), ValueError, "together"),
]


@pytest.mark.parametrize("case,edit,error,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_raises_before_any_write(case, edit, error, match):
    inputs = make_kv_inputs(case, "cpu")
    edit(inputs)
    caches = [inputs["k_cache"].clone(), inputs["v_cache"].clone()]
    with pytest.raises(error, match=re.escape(match)):
        call_kernel(case, inputs)
    torch.testing.assert_close(inputs["k_cache"], caches[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(inputs["v_cache"], caches[1], rtol=0, atol=0, equal_nan=True)


def test_unused_block_table_entries_are_not_checked():
    # make_kv_inputs marks pages past each sequence's end -1: accepted, never read.
    case = KVCase(page_size=16, s_new=1, seqlens="zero", s_cache=64)
    inputs = make_kv_inputs(case, "cpu")
    assert (inputs["block_table"][:, 1:] == -1).all()
    call_kernel(case, inputs)


def test_bad_page_size():
    q = torch.randn(1, 1, 2, 16, dtype=F16)
    cache = torch.zeros(4, 24, 2, 16, dtype=F16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 16"):
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=1, block_table=table)


def test_int_seqlens_beyond_cache():
    q = torch.randn(1, 1, 2, 16, dtype=F16)
    cache = torch.zeros(1, 8, 2, 16, dtype=F16)
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=9)
    k = torch.ones(1, 2, 2, 16, dtype=F16)
    with pytest.raises(ValueError, match="overflows"):
        flash_attn_with_kvcache(q, cache, cache, k=k, v=k, cache_seqlens=7)
    assert not cache.any()


def test_int_seqlens_beyond_the_rotary_table():
    """An int cache_seqlens needs no device read, and the rotary table's length is still
    checked (it once went unchecked when no tensor had to be read)."""
    q, k = (torch.randn(1, 1, 2, 16, dtype=F16) for _ in range(2))
    cache = torch.zeros(1, 32, 2, 16, dtype=F16)
    table = torch.randn(8, 8, dtype=F16)
    with pytest.raises(ValueError, match="8 positions, but position 20 is needed"):
        flash_attn_with_kvcache(
            q, cache, cache.clone(), k, k, rotary_cos=table, rotary_sin=table, cache_seqlens=20
        )
    assert not cache.any()


def test_cache_seqlens_read_once_per_version(monkeypatch):
    """The layers of one decode step share cache_seqlens: its values are read from the device
    once per tensor and in-place version, and an edit that overflows the cache still raises."""
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or original(t))
    q = torch.randn(2, 1, 2, 16, dtype=F16)
    k_cache, v_cache = (torch.randn(2, 16, 2, 16, dtype=F16) for _ in range(2))
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    first = [flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens) for _ in range(3)]
    assert sum(r is seqlens for r in reads) == 1
    assert all(torch.equal(first[0], out) for out in first[1:])
    seqlens += 7  # same tensor, new lengths: read again, and 16 is the cache's capacity
    shifted = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert sum(r is seqlens for r in reads) == 2
    assert not torch.allclose(first[0], shifted)
    seqlens[1] = 17
    with pytest.raises(ValueError, match="reaches 17, beyond the cache capacity 16"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)


@pytest.fixture
def signature_checks(monkeypatch):
    """An empty table of checked signatures, and a count of the full structural checks."""
    monkeypatch.setattr(kvcache, "_CHECKED", {})
    runs = []
    check_shapes = kvcache._check_shapes
    monkeypatch.setattr(kvcache, "_check_shapes", lambda *a: runs.append(1) or check_shapes(*a))
    return runs


def _decode_inputs(d=16, capacity=16):
    q = torch.randn(2, 1, 4, d, dtype=F16)
    k_cache, v_cache = (torch.randn(2, capacity, 2, d, dtype=F16) for _ in range(2))
    k, v = (torch.randn(2, 1, 2, d, dtype=F16) for _ in range(2))
    return q, k_cache, v_cache, k, v, torch.tensor([5, 9], dtype=torch.int32)


def test_structural_checks_once_per_signature(signature_checks):
    """A repeated call skips the checks its signature already passed and computes what the
    full checks would; a new stride, length, dtype or option checks in full again."""
    q, k_cache, v_cache, k, v, seqlens = _decode_inputs()
    kwargs = dict(cache_seqlens=seqlens, causal=True)
    outs = [flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs) for _ in range(3)]
    assert len(signature_checks) == 1
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    # The same values in a cache with other strides (a slice of wider rows): checked again, and
    # the same result.
    wide = torch.zeros(2, 16, 2, 32, dtype=F16)
    wide[..., :16] = k_cache
    strided = wide[..., :16]
    assert strided.shape == k_cache.shape and strided.stride() != k_cache.stride()
    assert torch.equal(flash_attn_with_kvcache(q, strided, v_cache, **kwargs), outs[0])
    assert len(signature_checks) == 2
    flash_attn_with_kvcache(q[:, :, :2], k_cache, v_cache, **kwargs)  # fewer query heads
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=False)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7, causal=True)  # an int
    assert len(signature_checks) == 5
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, causal=True)  # another int
    assert len(signature_checks) == 5


def test_checked_signature_still_rejects_what_it_does_not_fix(signature_checks):
    """After a call's signature passed, what the signature does not fix is still checked on
    every call (the int length's bound, the device values), and anything that changes the
    signature (a last-dim stride, a dtype, a head count) meets the full checks."""
    q, k_cache, v_cache, k, v, seqlens = _decode_inputs()
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    assert len(signature_checks) == 2
    caches = [k_cache.clone(), v_cache.clone()]
    with pytest.raises(ValueError, match="overflows"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=16)
    with pytest.raises(ValueError, match=r"must be in \[0, 16\]"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=17)
    seqlens[0] = 16  # the same tensor (and signature), a length with no room for the append
    with pytest.raises(ValueError, match="beyond the cache capacity 16"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
    assert len(signature_checks) == 2  # all three on checked signatures
    every_other = torch.zeros(2, 16, 2, 32, dtype=F16)[..., ::2]  # the shape, last stride 2
    with pytest.raises(ValueError, match="contiguous last dim"):
        flash_attn_with_kvcache(q, every_other, v_cache, k, v, cache_seqlens=3)
    with pytest.raises(TypeError, match="int32"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens.long())
    with pytest.raises(ValueError, match="multiple"):
        flash_attn_with_kvcache(q[:, :, :3], k_cache, v_cache, k, v, cache_seqlens=3)
    torch.testing.assert_close(k_cache, caches[0], rtol=0, atol=0)
    torch.testing.assert_close(v_cache, caches[1], rtol=0, atol=0)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(_compat, "INTERPRETER", False)  # kernels defined for a GPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 1, 2, 16, dtype=F16)
    cache = torch.zeros(1, 8, 2, 16, dtype=F16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=3)
