"""FP8 (float8_e4m3fn) attention forward with FlashAttention-3's descales, on the CPU.

The Triton interpreter runs the kernel's fp8 Q K^T dot (on the exact fp8 values, in fp32), so the
kernel's numerics are checked here on small shapes by the pass rule of `fp8_attention_testing`; its
P V product runs in fp32 here (the interpreter's bf16 dot is wrong) where the GPU's is bf16, which
tests/gpu/test_fp8_attention_gpu.py checks. The rest needs no kernel: validation and its errors, the
reference's dequantization, the dispatch, the fake (meta) implementation.

Shapes: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d(_v)]; varlen q [t_q, h, d]; descales
[b, h_kv].
"""

from __future__ import annotations

import logging

import pytest
import torch
from fp8_attention_testing import FP8, check_fp8, random_inputs, sequence_of_rows
from fusedlayers.kernels import dispatch
from fusedlayers.kernels._common import launch_geometry

import fusedlayers
from fusedlayers import ArgumentError, ArgumentTypeError, attention_reference, flash_attn_func
from fusedlayers.attention import validation
from fusedlayers.attention.reference import dequantize_fp8

# --------------------------------------------------------------------------------------------------
# The kernel under the interpreter
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "d, d_v, h, h_kv, s_q, s_k, causal",
    [
        (64, 64, 4, 2, 37, 45, True),  # GQA, odd lengths, bottom-right causal
        (64, 64, 4, 2, 37, 45, False),
        (40, 24, 3, 1, 33, 17, True),  # MQA, odd head dims, d_v != d, more queries than keys
        (256, 256, 2, 2, 9, 21, False),  # the largest head dim
    ],
)
def test_dense_matches_the_dequantized_reference(d, d_v, h, h_kv, s_q, s_k, causal):
    data = random_inputs(2, s_q, s_k, h, h_kv, d, d_v, device="cpu", seed=d + s_q)
    check_fp8(data, torch.float64, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_the_dequantized_reference(causal):
    """Three sequences of their own lengths, each with its own descales."""
    data = random_inputs(3, 29, 35, 4, 2, 64, 64, device="cpu", seed=3, varlen=True)
    check_fp8(data, torch.float64, causal=causal)


def test_windows_softcap_and_alibi_take_the_dequantized_scores():
    """The descales fold into the softmax scale, so softcap, ALiBi and windows act on the
    dequantized scores, as in the reference."""
    data = random_inputs(2, 25, 31, 2, 1, 32, 32, device="cpu", seed=11)
    slopes = torch.tensor([0.5, 0.125])
    check_fp8(data, torch.float64, window_size=(6, 3), softcap=5.0, alibi_slopes=slopes)
    check_fp8(data, torch.float64, softmax_scale=0.05)


def test_descales_default_to_one():
    """A descale left out counts as 1, in the kernel and the reference."""
    data = random_inputs(1, 17, 19, 2, 2, 64, 64, device="cpu", seed=5)
    q, k, v = data["q8"], data["k8"], data["v8"]
    out = flash_attn_func(q, k, v, v_descale=data["v_descale"])
    ref = attention_reference(q.float(), k.float(), v.float() * data["v_descale"][:, None, :, None])
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=0)
    bare = flash_attn_func(q, k, v).float()
    torch.testing.assert_close(bare, attention_reference(q, k, v).float(), atol=4e-2, rtol=0)


def test_paged_kv_and_empty_inputs():
    """block_table pages are gathered as fp8; an empty batch returns bf16 zeros."""
    data = random_inputs(2, 5, 16, 2, 1, 64, 64, device="cpu", seed=9)
    pages = (data["k8"].reshape(4, 8, 1, 64), data["v8"].reshape(4, 8, 1, 64))
    q = data["q8"].flatten(0, 1)
    cu_q = torch.tensor([0, 5, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 16, 32], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    descales = {f"{n}_descale": data[f"{n}_descale"] for n in "qkv"}
    paged = fusedlayers.flash_attn_varlen_func(
        q, *pages, cu_q, cu_k, 5, 16, block_table=table, **descales
    )
    dense = flash_attn_func(data["q8"], data["k8"], data["v8"], **descales)
    assert torch.equal(paged, dense.flatten(0, 1))
    empty = torch.empty(0, 4, 2, 64).to(FP8)
    out = flash_attn_func(empty, empty[:, :, :1], empty[:, :, :1])
    assert out.dtype == torch.bfloat16 and out.shape == (0, 4, 2, 64)


# --------------------------------------------------------------------------------------------------
# The reference path
# --------------------------------------------------------------------------------------------------


def test_dequantize_follows_sequences_and_kv_heads():
    """Row r of head i of sequence z is scaled by descale[z, i // (h / h_kv)], dense and packed
    (with gaps between sequences), checked element by element."""
    descale = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    x = torch.randn(2, 3, 4, 8).to(FP8)  # 4 query heads on 2 KV heads
    got = dequantize_fp8(x, descale)
    for z in range(2):
        for i in range(4):
            assert torch.equal(got[z, :, i], x[z, :, i].float() * descale[z, i // 2])
    packed = torch.randn(9, 2, 8).to(FP8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    offsets = torch.tensor([1, 5, 9], dtype=torch.int32)  # rows 0 and 4 belong to no sequence
    got = dequantize_fp8(packed, descale, cu, offsets)
    for z, rows in ((0, range(1, 4)), (1, range(5, 9))):
        for r in rows:
            assert torch.equal(got[r], packed[r].float() * descale[z][:, None])
    assert sequence_of_rows(cu, 7).tolist() == [0, 0, 0, 1, 1, 1, 1]


def test_reference_dequantizes_then_attends_in_fp32():
    """attention_reference on fp8 + descales is the fp32 reference on the dequantized inputs,
    rounded to bf16; the front end's reference backend takes the same path."""
    from fusedlayers.attention.frontend import attention

    data = random_inputs(2, 11, 13, 4, 2, 32, 32, device="cpu", seed=2)
    descales = {f"{n}_descale": data[f"{n}_descale"] for n in "qkv"}
    qkv8 = data["q8"], data["k8"], data["v8"]
    out, lse = attention_reference(*qkv8, window_size=(-1, 0), return_lse=True, **descales)
    want, want_lse = attention_reference(
        *(dequantize_fp8(t, descales[f"{n}_descale"]) for t, n in zip(qkv8, "qkv")),
        window_size=(-1, 0),
        return_lse=True,
    )
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16())
    assert torch.equal(lse, want_lse)
    front, front_lse = attention(
        *qkv8, qkv_format="bshd", attn_mask_type="causal_bottom_right", backend="reference",
        allow_fp8=True, **descales,
    )  # fmt: skip
    assert torch.equal(front, out) and torch.equal(front_lse, lse)


# --------------------------------------------------------------------------------------------------
# Validation: every error before any kernel runs, naming the argument and its value
# --------------------------------------------------------------------------------------------------


def _fp8(*shape):
    return torch.randn(shape).to(FP8)


Q, KV = _fp8(2, 5, 4, 16), _fp8(2, 7, 2, 16)
ONES = torch.ones(2, 2)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (dict(k=KV.bfloat16()), ArgumentTypeError, "q, k and v must all be torch.float8_e4m3fn"),
        (
            dict(q=Q.to(torch.float8_e5m2), k=KV.to(torch.float8_e5m2), v=KV.to(torch.float8_e5m2)),
            ArgumentTypeError,
            "got q torch.float8_e5m2",
        ),  # fmt: skip
        (dict(q_descale=ONES.double()), ArgumentError, "q_descale must be a float32 tensor"),
        (dict(v_descale=torch.ones(2, 4)), ArgumentError, "[batch, num_kv_heads] = [2, 2]"),
        (dict(k_descale=torch.ones(2)), ArgumentError, "got shape (2,)"),
        (dict(k_descale=torch.ones(2, 2, device="meta")), ArgumentError, "device meta"),
        (dict(q_descale=1.0), ArgumentTypeError, "q_descale must be a float32 tensor, got float"),
        (dict(q=Q.float().requires_grad_().to(FP8)), ArgumentError, "q requires grad"),
        (dict(v_descale=ONES.requires_grad_()), ArgumentError, "v_descale requires grad"),
        (dict(dropout_p=0.1), ArgumentError, "dropout_p=0.1"),
        (
            dict(q=_fp8(2, 5, 4, 272), k=_fp8(2, 7, 2, 272), v=_fp8(2, 7, 2, 272)),
            ArgumentError,
            "head dim 272 exceeds",
        ),  # fmt: skip
    ],
)
def test_bad_fp8_calls_name_the_argument(call, error, words):
    args = dict(q=Q, k=KV, v=KV) | call
    with pytest.raises(error) as caught:
        flash_attn_func(**args)
    assert words in str(caught.value)


def test_descales_with_16_bit_inputs_are_ignored():
    """As FlashAttention-3 does: callers written for it pass descales whatever the dtype."""
    q, k = torch.randn(2, 5, 4, 16).half(), torch.randn(2, 7, 2, 16).half()
    ignored = dict(q_descale=ONES * 3, k_descale=torch.ones(1), v_descale="unchecked")
    assert torch.equal(flash_attn_func(q, k, k, **ignored), flash_attn_func(q, k, k))


def test_forward_only_is_enforced_by_the_kernel_entry_too():
    from fusedlayers.kernels import flash_attention

    q = Q.float().requires_grad_().to(FP8)
    with pytest.raises(ValueError, match="forward only"):
        flash_attention(q, KV, KV, softmax_scale=0.25)
    with torch.no_grad():  # nothing is recorded: the forward runs
        assert flash_attention(q, KV, KV, softmax_scale=0.25)[0].dtype == torch.bfloat16


def test_the_modules_refuse_fp8():
    attn = fusedlayers.DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd")
    with pytest.raises(ArgumentTypeError, match="flash_attn_func and flash_attn_varlen_func only"):
        attn(Q, KV, KV)


def test_gpus_below_sm89_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ArgumentError) as caught:
        validation.check_fp8_device(torch.device("cuda", 0), "q")
    assert "float8_e4m3fn" in str(caught.value) and "compute capability 8.0" in str(caught.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    validation.check_fp8_device(torch.device("cuda", 0), "q")


# --------------------------------------------------------------------------------------------------
# Dispatch and the op's fake
# --------------------------------------------------------------------------------------------------


def test_the_sm90_forward_declines_fp8_and_says_why(monkeypatch, caplog):
    sm90 = dispatch.sm90_kernels("_flash_fwd_sm90")
    if not sm90.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(dispatch, "_on_sm90", lambda t: True)
    q, k = _fp8(1, 64, 2, 128), _fp8(1, 2048, 2, 128)
    with caplog.at_level(logging.DEBUG, logger="fusedlayers.kernels"):
        plan = dispatch.sm90_forward_plan(
            q, k, k, launch_geometry(q, k), window_left=-1, window_right=-1, bias=None,
            alibi_slopes=None, softcap=0.0, dropout_p=0.0,
        )  # fmt: skip
    assert plan is None
    (record,) = caplog.records
    assert "does not take this call: fp8 (float8_e4m3fn) inputs" in record.getMessage()


def test_opcheck_fp8():
    """The forward op's fake gives a bf16 output and takes descale as an ordinary tensor
    argument. (opcheck's schema test does arithmetic PyTorch has no fp8 kernel for.)"""
    from fusedlayers.kernels.attention_ops import flash_attn_fwd

    descale = torch.rand(2, 2, 3) + 0.5
    # main's op: ..., rng_state, deterministic, then the descale (its last, optional argument).
    args = (Q, KV, KV, *(None,) * 8, 0.25, -1, 0, True, None, None, 0.0, 0.0, None, False, descale)
    checks = ("test_autograd_registration", "test_faketensor")
    torch.library.opcheck(flash_attn_fwd, args, test_utils=checks)
    out, lse = flash_attn_fwd(*args)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_torch_compile_fullgraph_fp8():
    """torch.compile traces the fp8 call, descales included, without a graph break."""
    from fusedlayers.kernels import flash_attention

    data = random_inputs(2, 9, 12, 4, 2, 64, 64, device="cpu", seed=8)
    qkv = data["q8"], data["k8"], data["v8"]
    descales = [data[f"{n}_descale"] for n in "qkv"]

    def attend(q, k, v, q_descale, k_descale, v_descale):
        out, lse = flash_attention(
            q, k, v, softmax_scale=0.125, window_size=(-1, 0), q_descale=q_descale,
            k_descale=k_descale, v_descale=v_descale,
        )  # fmt: skip
        return out * 2, lse

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    eager = attend(*qkv, *descales)
    got = compiled(*qkv, *descales)
    assert got[0].dtype == torch.bfloat16
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])


# --------------------------------------------------------------------------------------------------
# main's routes: the signature cache, the kernel plans, planned calls, packed inputs, errors before
# any launch, the paths that refuse fp8
# --------------------------------------------------------------------------------------------------


def test_bad_calls_raise_before_any_kernel_runs(monkeypatch):
    """Every refusal above comes from the front end: no forward launch is reached."""
    from fusedlayers.kernels import attention_ops

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for a call that should have been refused")

    monkeypatch.setattr(attention_ops, "flash_attention_forward", no_launch)
    bad = (
        dict(q=Q.bfloat16()),
        dict(v_descale=torch.ones(2, 4)),
        dict(q_descale=ONES.double()),
        dict(k=Q.float().requires_grad_().to(FP8)),
        dict(dropout_p=0.5),
    )
    for call in bad:
        with pytest.raises(ArgumentError):  # ArgumentTypeError is an ArgumentError
            flash_attn_func(**(dict(q=Q, k=KV, v=KV) | call))


def test_varlen_descales_take_one_row_per_sequence():
    """Varlen: b = len(cu_seqlens_q) - 1 rows of descales, named with the expected shape."""
    q, kv = _fp8(9, 4, 16), _fp8(11, 2, 16)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    with pytest.raises(ArgumentError, match=r"k_descale must be .*\[2, 2\].*got shape \(3, 2\)"):
        fusedlayers.flash_attn_varlen_func(q, kv, kv, cu_q, cu_k, 5, 6, k_descale=torch.ones(3, 2))


def test_repeat_calls_are_checked_and_read_new_descales(monkeypatch):
    """fp8 calls never enter the front end's signature cache: a repeat of the same signature
    still checks for gradients (a cached call would have skipped the check) and reads the new
    descale values; the kernel's plans key on the descale tensor's presence, so calls with and
    without descales of one q/k/v signature interleave correctly."""
    from fusedlayers.attention import frontend

    monkeypatch.setattr(frontend, "_VALIDATED", {})
    data = random_inputs(2, 13, 21, 4, 2, 32, 32, device="cpu", seed=21)
    qkv = data["q8"], data["k8"], data["v8"]
    plain = flash_attn_func(*qkv)
    for factor in (1.0, 2.0, 1.0):
        descales = {f"{n}_descale": data[f"{n}_descale"] * factor for n in "qkv"}
        want = attention_reference(*qkv, **descales)
        got = flash_attn_func(*qkv, **descales)
        err = (got.double() - want.double()).abs().max().item()
        assert err <= 2e-2 * want.double().abs().max().item(), (factor, err)
        assert torch.equal(flash_attn_func(*qkv), plain)  # no descale: the same bits again
    assert not frontend._VALIDATED
    tracked = data["q_descale"].clone().requires_grad_()
    with pytest.raises(ArgumentError, match="q_descale requires grad"):
        flash_attn_func(*qkv, q_descale=tracked)


def test_plan_call_refuses_fp8():
    from fusedlayers.kernels.attention_ops import plan_call

    with pytest.raises(ValueError, match="float8_e4m3fn"):
        plan_call(Q, KV, KV, softmax_scale=0.25)


def test_packed_fp8_inputs_are_the_unpacked_call():
    """flash_attn_qkvpacked_func / kvpacked take fp8 views of one buffer and the descales."""
    data = random_inputs(2, 12, 12, 2, 2, 32, 32, device="cpu", seed=4)
    qkv = torch.stack([data["q8"].float(), data["k8"].float(), data["v8"].float()], 2).to(FP8)
    descales = {f"{n}_descale": data[f"{n}_descale"] for n in "qkv"}
    want = flash_attn_func(data["q8"], data["k8"], data["v8"], causal=True, **descales)
    got = fusedlayers.flash_attn_qkvpacked_func(qkv, causal=True, **descales)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got = fusedlayers.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True, **descales)
    assert torch.equal(got, want)


def test_paths_without_fp8_refuse_it():
    """flash_attn_with_kvcache and the TE-style front end (what the modules and context
    parallelism call) name the dtype; the reference backend of the front end takes fp8 only
    where the caller allows it."""
    from fusedlayers.attention.frontend import attention

    cache = _fp8(2, 8, 2, 16)
    with pytest.raises(ArgumentTypeError, match="float8_e4m3fn"):
        fusedlayers.flash_attn_with_kvcache(Q[:, :1], cache, cache)
    for backend in ("reference", "kernel"):
        with pytest.raises(ArgumentTypeError, match="flash_attn_func and flash_attn_varlen_func"):
            attention(Q, KV, KV, qkv_format="bshd", backend=backend)
