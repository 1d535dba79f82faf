"""Context parallelism on CPU: 2, 3 and 4 processes joined by gloo, each holding a slice of every
sequence, against one process attending the full sequences in fp64.

Pass rule: the ring's max error is at most 2x (outputs) or 3x (gradients) PyTorch's own error in
the input dtype, plus an atol of (cp + 1) units of fp32 at the result's magnitude. The atol is
the ring's own rounding: the LSE is fp32 by contract (on the fp64 reference path too), each
ring step's block output is rounded before the merge, and dK/dV gather one term per rank.
A wrong block, mask, merge or gradient route errs by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from context_parallel_testing import CPCase, run_cases, run_layer_cases, run_repeats
from distributed_testing import run_on_ranks
from repeat_testing import SEQUENCES

import fusedlayers.attention.context_parallel as cp_module
from fusedlayers import DotProductAttention
from fusedlayers.attention.context_parallel import (
    context_parallel_attention,
    context_parallel_indices,
)

FP32_EPS = torch.finfo(torch.float32).eps


def _check(cases: list[CPCase], per_rank: list[list[dict]], world: int) -> None:
    failures = []
    for rank, reports in enumerate(per_rank):
        for case, report in zip(cases, reports):
            for name, r in report.items():
                factor = 3.0 if name.split()[-1].startswith("d") else 2.0
                atol = (world + 1) * FP32_EPS * max(r["magnitude"], 1.0)
                bound = factor * r["pytorch_error"] + atol
                if not r["error"] <= bound:
                    failures.append(
                        f"{case} rank {rank} {name}: error {r['error']:.3e} > {factor:g} x "
                        f"PyTorch {r['pytorch_error']:.3e} + atol {atol:.1e}"
                    )
    assert not failures, "\n".join(failures)


def test_ring_matches_full_sequence_two_ranks():
    """Every format and mask the ring takes, MHA/GQA/MQA, through DotProductAttention and the
    functional entry, forward and backward, on the reference path."""
    cases = [
        CPCase(fmt, mask, heads=4, kv_heads=2)
        for fmt in ("bshd", "sbhd", "thd")
        for mask in ("causal", "no_mask")
    ]
    cases += [
        CPCase("thd", "padding_causal", heads=2, kv_heads=2, d=16, d_v=8),
        CPCase("bshd", "causal", heads=4, kv_heads=1, module=False),
        CPCase("sbhd", "causal_bottom_right", heads=3, kv_heads=3, module=False),
    ]
    _check(cases, run_on_ranks(2, run_cases, cases), 2)


def test_ring_on_the_kernels_two_ranks():
    """The same ring driving the Triton kernels' forward (with LSE) and backward (from the
    merged out and LSE), under the CPU interpreter, fp32."""
    small = dict(s=16, seqlens=(8, 16), dtype="float32", backend="kernel", module=False)
    cases = [
        CPCase("bshd", "causal", **small),
        CPCase("thd", "padding_causal", **small),
        CPCase("sbhd", "no_mask", heads=4, kv_heads=1, **small),
    ]
    _check(cases, run_on_ranks(2, run_cases, cases), 2)


@pytest.mark.parametrize("order", SEQUENCES)
@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_ring_repeated_calls(order, backend):
    """One module (or functional entry) per signature called again and again on the same leaf
    tensors, with and without grad in both orders and interleaved with a second signature
    (`repeat_testing`): every call's output and gradients against the full sequences.
    `kernel`: the Triton kernels under the interpreter, fp32, through the functional entry."""
    kernel = backend == "kernel"
    common = dict(dtype="float32" if kernel else "float64", backend=backend, module=not kernel)
    cases = [
        CPCase("bshd", "causal", s=16, **common),
        CPCase("thd", "no_mask", heads=2, kv_heads=1, seqlens=(8, 16), **common),
    ]
    per_rank = run_on_ranks(2, run_repeats, cases, order)
    labels = [f"{order} call {i}" for i in range(len(SEQUENCES[order]))]
    _check(labels, per_rank, 2)


@pytest.mark.parametrize("world", [3, 4])
def test_ring_three_and_four_ranks(world):
    """Longer rings: K/V pass through ranks that do not own them, and dK/dV travel cp hops."""
    size = dict(s=24, seqlens=(12, 24, 36) if world == 3 else (8, 24, 16))
    cases = [CPCase("bshd", "causal", **size), CPCase("thd", "causal", heads=4, kv_heads=1, **size)]
    _check(cases, run_on_ranks(world, run_cases, cases), world)


def test_transformer_layer_and_gpt_two_ranks():
    """A causal GQA TransformerLayer with RoPE, and a GPT (RoPE or learned positions): outputs
    and input gradients of each slice, and parameter gradients summed over ranks, equal one
    process on the full sequences (each token keeps its position in the full sequence). fp64
    reference path; the fp32 LSE bounds the error near 1e-7."""
    per_rank = run_on_ranks(2, run_layer_cases, ["bshd", "sbhd", "thd"])
    for rank, reports in enumerate(per_rank):
        for case, report in reports.items():
            bad = {name: err for name, err in report.items() if not err < 1e-6}
            assert not bad, f"{case} rank {rank}: {bad}"


def test_context_parallel_indices_follow_te_load_balancing():
    # 2 ranks, one sequence of 8 in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 1 and 2.
    assert context_parallel_indices([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert context_parallel_indices([8], 2, 1).tolist() == [2, 3, 4, 5]
    # thd: the same per sequence, sequences back to back.
    assert context_parallel_indices([4, 8], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by 2 \\* cp_size"):
        context_parallel_indices([6], 2, 0)


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A one-process gloo group, torn down afterwards; the ring must not start (the checks
    come before any compute)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )

    def no_compute(*args):
        raise AssertionError("the ring started before the arguments were checked")

    monkeypatch.setattr(cp_module.RingAttention, "apply", no_compute)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _qkv(fmt="bshd", s=8):
    shape = (16, 4, 8) if fmt == "thd" else (2, s, 4, 8)
    return [torch.randn(shape, dtype=torch.float64) for _ in range(3)]


BAD_CALLS = [
    (dict(attn_mask_type="padding"), "attn_mask_type='padding' is not supported"),
    (dict(attn_mask_type="arbitrary"), "attn_mask_type='arbitrary' is not supported"),
    (dict(window_size=(4, 0)), "window_size=\\(4, 0\\) is not supported"),
    (dict(dropout_p=0.1), "attention_dropout=0.1 is not supported"),
    (dict(core_attention_bias_type="alibi"), "core_attention_bias_type='alibi'"),
    (dict(qkv=_qkv(s=7)), "local query_layer length 7"),
    (
        dict(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 8], dtype=torch.int32)),
        "every sequence length must be divisible by 2 \\* cp_size = 2, got \\[3, 5\\]",
    ),
    (
        dict(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4, 16], dtype=torch.int32)),
        "cu_seqlens_q ends at 16, but .* 8 tokens on this rank x cp_size 1 = 8",
    ),
    (
        dict(
            qkv_format="thd",
            cu_seqlens_q=torch.tensor([0, 4, 8], dtype=torch.int32),
            cu_seqlens_q_padded=torch.tensor([0, 6, 8], dtype=torch.int32),
        ),
        "cu_seqlens_q_padded=\\[0, 6, 8\\] differs from cu_seqlens_q",
    ),
]


@pytest.mark.parametrize("call, message", BAD_CALLS)
def test_bad_calls_raise_before_any_compute(one_rank_group, call, message):
    call = dict(call)
    fmt = call.get("qkv_format", "bshd")
    q, k, v = call.pop("qkv", None) or _qkv(fmt)
    if fmt == "thd":
        q, k, v = (t[:8] for t in (q, k, v))  # 8 local tokens
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(q, k, v, cp_group=one_rank_group, **call)


def test_module_arguments_are_checked(one_rank_group):
    with pytest.raises(ValueError, match="cp_comm_type='a2a' is not supported"):
        DotProductAttention(4, 8, cp_group=one_rank_group, cp_comm_type="a2a")
    with pytest.raises(ValueError, match="cp_global_ranks=\\[3\\] does not match"):
        DotProductAttention(4, 8, cp_group=one_rank_group, cp_global_ranks=[3])
    attn = DotProductAttention(4, 8, qkv_format="bshd", cp_group=one_rank_group)
    with pytest.raises(ValueError, match="attention_mask is not supported"):
        attn(*_qkv(), attention_mask=torch.zeros(2, 1, 1, 8, dtype=torch.bool))
    attn.set_context_parallel_group(None)  # off again: the ordinary path, any length
    q, k, v = _qkv(s=7)
    assert attn(q, k, v).shape == (2, 7, 32)
