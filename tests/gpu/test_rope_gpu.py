"""The fused RoPE kernel on the GPU at model sizes, bf16 and fp16: forward and gradient against the
fp64 PyTorch path (the pass rule of tests/test_rope_kernel.py, whose harness this reuses), the
`auto` choice on CUDA, torch.compile(fullgraph=True) with inductor, and MultiheadAttention with
rotary_pos_emb on the kernels against use_reference=True."""

from __future__ import annotations

import copy

import pytest
import torch
from test_rope_kernel import RopeCase, check_rope_case, make_inputs, qk_views

import fusedlayers.layers.rope as rope_front
from fusedlayers.layers.multihead_attention import MultiheadAttention
from fusedlayers.layers.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# TransformerEngine's elementwise attention tolerance (tests/gpu/test_layers_gpu.py's DPA_TOL).
MHA_TOL = {torch.float16: 1e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_matches_fp64_reference(dtype, d, fmt, interleaved):
    """b=2, s=1024, h=8: q as a head slice of a fused QKV tensor, the gradient with
    stride(-1) != 1."""
    case = RopeCase(
        fmt=fmt, b=2, s=1024, h=8, d=d, dtype=dtype, interleaved=interleaved, strided="heads"
    )
    check_rope_case(case, "cuda")


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_partial_rotation_and_positions(dtype, fmt):
    """Half the channels rotate (rotary_percent 0.5), positions from start offsets / cu_seqlens;
    k from a per-head fused [.., h, 3, d] tensor (head stride 3d)."""
    case = RopeCase(
        fmt=fmt, b=2, s=512, h=12, d=128, d_rot=64, dtype=dtype, start=True, strided="per_head"
    )
    check_rope_case(case, "cuda")


def test_auto_takes_the_kernel_on_cuda():
    t = torch.randn(64, 2, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    freqs = RotaryPositionEmbedding(64).cuda()(64)
    assert type(apply_rotary_pos_emb(t, freqs).grad_fn).__name__ == "_EagerRopeBackward"
    assert rope_front._use_kernel("auto", t, freqs, "sbhd") == (True, "CUDA tensors")
    # A table that wants its gradient goes to the PyTorch path, which has one.
    freqs.requires_grad_()
    out = apply_rotary_pos_emb(t, freqs)
    assert type(out.grad_fn).__name__ != "_EagerRopeBackward"
    assert torch.autograd.grad(out.float().sum(), freqs)[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(
    "fmt, groups, start", [("bshd", 8, False), ("sbhd", 2, False), ("thd", 4, True)]
)
def test_pair_equals_two_calls(dtype, fmt, groups, start):
    """q and k of one projection (GQA group-interleaved rows, as MultiheadAttention makes them)
    rotated in one launch each way: the same bits as two launches, forward and backward."""
    case = RopeCase(fmt=fmt, b=2, s=512, h=8, d=128, d_rot=64, dtype=dtype, start=start)
    inputs = {k: v if v is None else v.cuda() for k, v in make_inputs(case).items()}
    mixed, q, k = qk_views(case, groups, dtype, "cuda")
    rope = dict(
        tensor_format=fmt, start_positions=inputs["start_positions"],
        cu_seqlens=inputs["cu_seqlens"], backend="kernel",
    )  # fmt: skip
    pair = rope_front.rotate_qk(q, k, inputs["freqs"], **rope)
    apart = [apply_rotary_pos_emb(t, inputs["freqs"], **rope) for t in (q, k)]
    douts = [torch.randn_like(t) for t in pair]
    got = torch.autograd.grad(pair, mixed, douts)
    want = torch.autograd.grad(apart, mixed, douts)
    for a, b in zip((*pair, *got), (*apart, *want)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_compiled_matches_eager(fmt):
    """torch.compile(fullgraph=True, inductor) traces the custom ops and runs the same kernel;
    only the cos/sin tables come from inductor's code, hence a tight tolerance, not bitwise."""
    torch._dynamo.reset()
    shape = (2, 256, 8, 64) if fmt == "bshd" else (256, 2, 8, 64)
    t = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    freqs = RotaryPositionEmbedding(64).cuda()(512)

    def fn(x):
        return apply_rotary_pos_emb(x, freqs, fmt)

    compiled = torch.compile(fn, fullgraph=True)
    eager_out, compiled_out = fn(t), compiled(t)
    torch.testing.assert_close(compiled_out, eager_out, atol=1e-2, rtol=0)
    dy = torch.randn_like(eager_out)
    (eager_dt,) = torch.autograd.grad(eager_out, t, dy)
    (compiled_dt,) = torch.autograd.grad(compiled_out, t, dy)
    torch.testing.assert_close(compiled_dt, eager_dt, atol=1e-2, rtol=0)


@pytest.fixture
def rope_calls(monkeypatch):
    """The tensors the front end sends to the RoPE kernel entries (a pair counts two)."""
    calls = []
    original, original_pair = rope_front.rope, rope_front.rope_pair

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    def counting_pair(*args, **kwargs):
        calls.extend((args[0].shape, args[1].shape))
        return original_pair(*args, **kwargs)

    monkeypatch.setattr(rope_front, "rope", counting)
    monkeypatch.setattr(rope_front, "rope_pair", counting_pair)
    return calls


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_mha_rope_on_kernels_vs_reference(rope_calls, dtype, fmt, interleaved):
    """MultiheadAttention (fused, group-interleaved QKV: q and k reach RoPE as strided views) on
    the kernels, against the same module with use_reference=True: outputs and input gradients
    within TE's attention tolerance. tests/gpu/test_layers_gpu.py's test_mha_rope_kernel_vs_
    reference holds the same modules to the 2x-PyTorch-error rule against fp32."""
    torch.manual_seed(0)
    mha = MultiheadAttention(
        512, 8, num_gqa_groups=2, kv_channels=64, attention_dropout=0.0, fuse_qkv_params=True,
        qkv_weight_interleaved=True, qkv_format=fmt, rotary_pos_interleaved=interleaved,
        params_dtype=dtype, device="cuda",
    )  # fmt: skip
    table = RotaryPositionEmbedding(64, interleaved=interleaved).cuda()(512)
    shape = (2, 256, 512) if fmt == "bshd" else (256, 2, 512)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    reference = copy.deepcopy(mha)
    reference.use_reference = True
    results = []
    for module in (mha, reference):
        inp = x.clone().requires_grad_()
        out = module(inp, rotary_pos_emb=table)
        (dx,) = torch.autograd.grad(out, inp, torch.ones_like(out) / out.shape[-1] ** 0.5)
        results.append((out.float(), dx.float()))
        assert len(rope_calls) == 2  # q and k on the kernels; none on the reference path
    tol = MHA_TOL[dtype]
    for name, got, want in zip(("out", "dx"), *results):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
