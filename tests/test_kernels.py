"""Triton attention kernels under the CPU interpreter: every issue-3 feature, forward and backward.

Each case runs `fusedlayers.kernels.flash_attention` (forward, then backward with a random
upstream gradient) and compares out, LSE, dq, dk, dv (and dbias) with the reference in fp64 under
the pass rule of `attention_testing` (2x / 3x PyTorch's own error in the input dtype). The
interpreter is slow and its bf16 `tl.dot` is broken (Triton issue 11584), so cases are tiny and
fp16/fp32 only; the GPU suite (tests/gpu/test_kernels_gpu.py) runs the full matrix and bf16.
The interpreter configs use BLOCK_M 32 / BLOCK_N 16 (forward) and 16 x 16 (backward), so
lengths past 16 and 32 exercise the multi-block loops and the block skipping of windows.
"""

import dataclasses

import pytest
import torch
from attention_testing import Case, check_case, make_inputs, run_kernel
from fusedlayers.kernels import attention_ops, dropout_keep_mask, flash_attention
from fusedlayers.kernels.attention_ops import flash_attn_bwd, flash_attn_fwd

F16, F32 = torch.float16, torch.float32
CAUSAL = (-1, 0)


def _ids(cases):
    return [c.label() for c in cases]


# Odd head dims padded to powers of two, d_v != d_qk, s = 1, s_q != s_k both ways, fp32 inputs.
SHAPES = [
    Case(d=40, s_q=7, s_k=21),
    Case(d=59, s_q=37, s_k=6, dtype=F32, b=1),
    Case(d=8, d_v=24, s_q=1, s_k=17),
    Case(d=111, d_v=40, s_q=5, s_k=3, b=1, h=1, h_kv=1),
    Case(d=16, s_q=1, s_k=1, window=CAUSAL),
]


@pytest.mark.parametrize("case", SHAPES, ids=_ids(SHAPES))
def test_head_dims_and_lengths(case, device):
    check_case(case, device)


# MHA / GQA / MQA (K/V never repeated) across causal top-left / bottom-right and windows.
MASKS = [
    Case(h=4, h_kv=4, s_q=23, s_k=9, window=CAUSAL),
    Case(h=4, h_kv=2, s_q=9, s_k=23, window=CAUSAL, bottom_right=False),
    Case(h=4, h_kv=1, s_q=34, s_k=41, window=(5, 3)),
    Case(h=2, h_kv=1, s_q=40, s_k=19, window=(6, 0), bottom_right=False, dtype=F32, b=1),
    Case(h=3, h_kv=1, s_q=12, s_k=35, window=(0, 4), d=32),
]


@pytest.mark.parametrize("case", MASKS, ids=_ids(MASKS))
def test_heads_and_masks(case, device):
    check_case(case, device)


# thd with cu_seqlens, with gaps between sequences (seq_offsets), and right-padded dense
# batches given as seqlens.
LAYOUTS = [
    Case(layout="varlen", b=3, s_q=19, s_k=23, h=4, h_kv=2, window=CAUSAL),
    Case(layout="varlen_padded", b=3, s_q=17, s_k=13, window=(4, 2), dtype=F32),
    Case(layout="varlen_padded", b=2, s_q=6, s_k=9, h=2, h_kv=1, window=(-1, 0)),
    Case(layout="seqlens", b=3, s_q=18, s_k=11, window=CAUSAL),
    Case(layout="seqlens", b=2, s_q=7, s_k=20, bottom_right=False, window=(3, -1), dtype=F32),
]


@pytest.mark.parametrize("case", LAYOUTS, ids=_ids(LAYOUTS))
def test_varlen_and_padding(case, device):
    check_case(case, device)


# Additive bias in every broadcast shape (an expand()ed view with stride-0 dims) and its
# gradient (autograd sums it back onto the un-expanded tensor); ALiBi; softcap; softmax_scale.
SCORES = [
    Case(bias="1hss", s_q=11, s_k=19),
    Case(bias="b1ss", s_q=11, s_k=19, window=CAUSAL, h=2, h_kv=1),
    Case(bias="bhss", s_q=9, s_k=6, dtype=F32),
    Case(bias="11ss", s_q=5, s_k=18, b=1),
    Case(bias="111s", s_q=7, s_k=7, window=CAUSAL, bottom_right=False),
    Case(alibi="batch", s_q=10, s_k=21, window=CAUSAL),
    Case(alibi="shared", s_q=21, s_k=10, bottom_right=False, h=4, h_kv=2, dtype=F32),
    Case(alibi="batch", layout="varlen", b=3, s_q=9, s_k=18),
    Case(softcap=2.5, softmax_scale=0.5, s_q=9, s_k=20, bias="1hss"),
    Case(softcap=5.0, layout="varlen", b=2, s_q=13, s_k=8, dtype=F32, window=CAUSAL),
]


@pytest.mark.parametrize("case", SCORES, ids=_ids(SCORES))
def test_bias_alibi_softcap(case, device):
    check_case(case, device)


def test_bias_without_grad(device):
    """A bias that does not require grad: no dbias work, same dq/dk/dv bitwise."""
    case = Case(bias="b1ss", s_q=9, s_k=17, window=CAUSAL)
    inputs = make_inputs(case, device)
    with_grad = run_kernel(case, inputs)
    q, k, v = (inputs[n].detach().requires_grad_() for n in ("q", "k", "v"))
    bias = inputs["bias_leaf"].expand(case.b, case.h, case.s_q, case.s_k)
    out, _ = flash_attention(q, k, v, softmax_scale=case.scale, window_size=CAUSAL, bias=bias)
    grads = torch.autograd.grad(out, (q, k, v), inputs["dout"])
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert torch.equal(grad, with_grad[name]), name


# Dropout: the reference is fed the keep-mask from `dropout_keep_mask`, so forward and the
# backward's regenerated mask must both match it element for element.
DROPOUT = [
    Case(dropout_p=0.3, s_q=19, s_k=21),
    Case(dropout_p=0.2, layout="varlen", b=2, s_q=11, s_k=17, window=CAUSAL, h=2, h_kv=1),
    Case(dropout_p=0.5, bias="1hss", s_q=9, s_k=12, dtype=F32, b=1),
]


@pytest.mark.parametrize("case", DROPOUT, ids=_ids(DROPOUT))
def test_dropout_matches_reference(case, device):
    check_case(case, device)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_fraction_and_keying(p, device):
    """Dropped fraction within 1% of p on 262k draws (5 standard deviations at p = 0.5); the
    mask is a pure function of the state."""
    state = torch.tensor([1234, 56], dtype=torch.int64)
    keep = dropout_keep_mask(state, 2, 2, 256, 256, p, device)
    assert keep.shape == (2, 2, 256, 256) and keep.dtype == torch.bool
    dropped = 1.0 - keep.float().mean().item()
    assert abs(dropped - p) < 0.01, f"dropped fraction {dropped:.4f} vs p = {p}"
    assert torch.equal(keep[:, :, :40, :40], dropout_keep_mask(state, 2, 2, 40, 40, p, device))
    other = dropout_keep_mask(torch.tensor([1234, 57]), 2, 2, 40, 40, p, device)
    assert not torch.equal(keep[:, :, :40, :40], other)
    # Heads and batch entries draw independently.
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])


def test_dropout_default_generator(device):
    """Without rng_state the state comes from torch's default generator: seeded runs repeat."""
    case = Case(dropout_p=0.4, s_q=8, s_k=8)
    inputs = make_inputs(case, device)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(run_kernel(case, inputs, rng_state=None, backward=False)["out"])
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_fully_masked_rows(device):
    """Rows with no visible key: out exactly 0, LSE -inf, zero gradients, no NaN anywhere."""
    # Bottom-right causal with s_q > s_k: the first s_q - s_k queries see no key.
    case = Case(s_q=21, s_k=6, window=CAUSAL, h=2, h_kv=1, bias="1hss")
    check_case(case, device)
    result = run_kernel(case, make_inputs(case, device))
    empty = slice(0, case.s_q - case.s_k)
    assert torch.equal(result["out"][:, empty], torch.zeros_like(result["out"][:, empty]))
    assert torch.isneginf(result["lse"][:, :, empty]).all()
    assert torch.equal(result["dq"][:, empty], torch.zeros_like(result["dq"][:, empty]))
    assert (result["dbias"][:, :, empty] == 0).all()
    assert all(not torch.isnan(t).any() for t in result.values())


def test_empty_key_sequence(device):
    """A varlen sequence with no keys: its queries give out 0, LSE -inf, dq 0, and the other
    sequence is unaffected (equal to running it alone)."""
    case = Case(layout="varlen_padded", b=2, s_q=6, s_k=9, h=2, h_kv=1, empty_k=True)
    inputs = make_inputs(case, device)
    result = run_kernel(case, inputs)
    assert all(not torch.isnan(t).any() for t in result.values())
    start, end = inputs["seq_offsets_q"][1].item(), inputs["seq_offsets_q"][1].item()
    end += inputs["cu_seqlens_q"].diff()[1].item()
    assert (result["out"][start:end] == 0).all() and (result["dq"][start:end] == 0).all()
    assert torch.isneginf(result["lse"][:, start:end]).all()
    alone = {**inputs, "cu_seqlens_q": inputs["cu_seqlens_q"][:2]}
    alone.update(cu_seqlens_k=inputs["cu_seqlens_k"][:2])
    alone.update(
        seq_offsets_q=inputs["seq_offsets_q"][:2], seq_offsets_k=inputs["seq_offsets_k"][:2]
    )
    first = run_kernel(dataclasses.replace(case, b=1), alone)
    rows = slice(inputs["seq_offsets_q"][0].item(), start)
    assert torch.equal(result["out"][rows], first["out"][rows])
    assert torch.equal(result["dk"], first["dk"]) and torch.equal(result["dv"], first["dv"])


def _owned_rows(inputs: dict, name: str) -> torch.Tensor:
    """Bool [rows]: True for memory rows of `name` ("q" or "k") that belong to a sequence."""
    owned = torch.zeros(inputs[name].shape[0], dtype=torch.bool, device=inputs[name].device)
    lens = inputs[f"cu_seqlens_{name}"].diff().tolist()
    for start, n in zip(inputs[f"seq_offsets_{name}"].tolist(), lens):
        owned[start : start + n] = True
    return owned


def test_padded_rows_are_zero(device):
    """Rows between varlen sequences belong to no sequence: out, LSE and gradients are 0/-inf."""
    case = Case(layout="varlen_padded", b=3, s_q=7, s_k=9)
    inputs = make_inputs(case, device)
    result = run_kernel(case, inputs)
    for name in ("q", "k"):
        grad = result[f"d{name}"][~_owned_rows(inputs, name)]
        assert grad.numel() > 0 and torch.equal(grad, torch.zeros_like(grad)), name
    unowned_q = ~_owned_rows(inputs, "q")
    assert (result["out"][unowned_q] == 0).all()
    assert torch.isneginf(result["lse"][:, unowned_q]).all()


def test_deterministic_repeats(device):
    """deterministic=True: forward and backward (GQA dk/dv, dbias) bitwise equal run to run."""
    case = Case(h=4, h_kv=1, s_q=20, s_k=20, window=CAUSAL, bias="b1ss", deterministic=True)
    inputs = make_inputs(case, device)
    first, second = run_kernel(case, inputs), run_kernel(case, inputs)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def _packed_dense(case, device):
    """GQA q/k/v split along heads of one [b, s, h + 2*h_kv, d] buffer (TransformerEngine
    issue 1195's layout): strided views, none of them contiguous."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(case.b, case.s_q, case.h + 2 * case.h_kv, case.d, generator=g)
    buf = buf.to(device=device, dtype=case.dtype)
    q, k, v = buf.split([case.h, case.h_kv, case.h_kv], dim=2)
    return q, k, v, {}


def _packed_varlen(case, device):
    """thd q/k/v as views of one [t, 3, h, d] buffer, with two sequences."""
    g = torch.Generator().manual_seed(4)
    buf = torch.randn(case.s_q + 5, 3, case.h, case.d, generator=g).to(device, case.dtype)
    cu = torch.tensor([0, case.s_q, case.s_q + 5], dtype=torch.int32, device=device)
    meta = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=case.s_q, max_seqlen_k=case.s_q)
    return buf[:, 0], buf[:, 1], buf[:, 2], meta


@pytest.mark.parametrize("packing", [_packed_dense, _packed_varlen], ids=["bshd-split", "t3hd"])
def test_packed_views_equal_contiguous(packing, device):
    """Packed views are read in place through their strides: bitwise the contiguous result."""
    case = Case(h=4, h_kv=2 if packing is _packed_dense else 4, s_q=18, d=24)
    q, k, v, meta = packing(case, device)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device=device).to(case.dtype)
    results = []
    for tensors in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        # detach() keeps the views' strides: the first run reads the packed buffer in place.
        leaves = [t.detach().requires_grad_() for t in tensors]
        out, lse = flash_attention(*leaves, **meta, softmax_scale=0.2, window_size=CAUSAL)
        grads = torch.autograd.grad(out, leaves, dout)
        results.append((out, lse, *grads))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


def _compiled_inputs(device):
    case = Case(h=4, h_kv=2, s_q=9, s_k=12, bias="1hss")
    inputs = make_inputs(case, device)
    leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k", "v", "bias_leaf")]
    return case, inputs, leaves


def test_torch_compile_fullgraph(device):
    """torch.compile(fullgraph=True) traces forward, backward and the rng draw: no graph break."""
    case, inputs, leaves = _compiled_inputs(device)

    def attend(q, k, v, bias, dropout_p):
        bias = bias.expand(case.b, case.h, case.s_q, case.s_k)
        out, lse = flash_attention(
            q, k, v, softmax_scale=0.3, window_size=CAUSAL, bias=bias, dropout_p=dropout_p
        )
        return out * 2, lse

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    eager_out, eager_lse = attend(*leaves, 0.0)
    out, lse = compiled(*leaves, 0.0)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert lse.requires_grad and eager_lse.requires_grad  # the LSE is differentiable too
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(1)).to(lse)
    upstream = (inputs["dout"], dlse)
    grads = torch.autograd.grad((out, lse), leaves, upstream)
    eager_grads = torch.autograd.grad((eager_out, eager_lse), leaves, upstream)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)
    # The rng_state draw (torch.randint) is traced too: seeded compiled runs repeat.
    torch.manual_seed(7)
    first = compiled(*leaves, 0.3)[0]
    torch.manual_seed(7)
    assert torch.equal(first, compiled(*leaves, 0.3)[0])


def test_entry_routes_eager_calls_around_the_dispatcher(device, monkeypatch):
    """Eager calls skip the torch.library dispatch (host time, see kernels/_routes.py): the
    autograd.Function when a gradient is needed, the bare launch otherwise; torch.compile traces
    the custom op. The results are the same bits on every route."""
    case, inputs, leaves = _compiled_inputs(device)
    q, k, v = leaves[:3]
    op_calls = []
    op = attention_ops.flash_attn_fwd
    monkeypatch.setattr(attention_ops, "flash_attn_fwd", lambda *a: op_calls.append(1) or op(*a))

    def attend(q, k, v):
        return flash_attention(q, k, v, softmax_scale=0.3, window_size=CAUSAL)[0]

    eager = attend(q, k, v)
    assert type(eager.grad_fn).__name__ == "_EagerFlashAttentionBackward"
    with torch.no_grad():
        bare = attend(q, k, v)
    assert bare.grad_fn is None and attend(q.detach(), k.detach(), v.detach()).grad_fn is None
    assert op_calls == []
    monkeypatch.undo()
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    compiled = torch.compile(attend, fullgraph=True, backend=record)(q, k, v)
    assert "fusedlayers.flash_attn_fwd.default" in seen
    assert torch.equal(compiled, eager) and torch.equal(bare, eager)


def test_forward_consults_the_autotuner_once_per_launch_signature(device, monkeypatch):
    """Later launches reuse the autotuner's pick (its per-call key building costs ~100 us of host
    time on the H100's host) and compute the same bits; a new signature or length bucket asks
    it again."""
    from fusedlayers.kernels import _flash_fwd

    monkeypatch.setattr(_flash_fwd, "_PICKED", {})
    calls = []
    tuner_run = _flash_fwd._attn_fwd.run
    monkeypatch.setattr(
        _flash_fwd._attn_fwd, "run", lambda *a, **k: calls.append(1) or tuner_run(*a, **k)
    )
    case = Case(h=2, h_kv=1, s_q=9, s_k=12)
    inputs = make_inputs(case, device)
    q, k, v = (inputs[n] for n in ("q", "k", "v"))
    first = flash_attention(q, k, v, softmax_scale=0.3, window_size=CAUSAL)
    second = flash_attention(q, k, v, softmax_scale=0.3, window_size=CAUSAL)
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    flash_attention(q, k, v, softmax_scale=0.3)  # no window: another signature
    assert len(calls) == 2
    # The autotuner's length bucket (a power of two from 256): 12 keys and 200 share one, 300
    # starts the next, so it is asked once more.
    longer = make_inputs(Case(h=2, h_kv=1, s_q=9, s_k=200), device)
    flash_attention(*(longer[n] for n in ("q", "k", "v")), softmax_scale=0.3)
    assert len(calls) == 2
    longest = make_inputs(Case(h=2, h_kv=1, s_q=9, s_k=300), device)
    flash_attention(*(longest[n] for n in ("q", "k", "v")), softmax_scale=0.3)
    assert len(calls) == 3


def test_opcheck(device):
    """torch.library.opcheck: schemas, fake (meta) shapes/strides, autograd registration."""
    case = Case(h=2, h_kv=1, s_q=5, s_k=7, bias="1hss")
    inputs = make_inputs(case, device)
    q, k, v, bias = (inputs[n].detach().requires_grad_() for n in ("q", "k", "v", "bias_leaf"))
    bias = bias.expand(case.b, case.h, case.s_q, case.s_k)
    rng = torch.tensor([5, 6], dtype=torch.int64)
    seq = (None,) * 8
    fwd_args = (q, k, v, *seq, 0.3, -1, 0, True, bias, None, 0.0, 0.25, rng, False)
    torch.library.opcheck(flash_attn_fwd, fwd_args)
    # The backward op has no autograd formula of its own (no double backward), so the AOT
    # dispatch check, which differentiates through the op, does not apply to it.
    q, k, v, bias = (t.detach() for t in (q, k, v, bias))
    out, lse = flash_attn_fwd(q, k, v, *fwd_args[3:])
    bwd_args = (inputs["dout"], q, k, v, out, lse, *seq, 0.3, -1, 0, True, bias, True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(
        flash_attn_bwd, (*bwd_args, None, 0.0, 0.25, rng, False), test_utils=checks
    )


def test_opcheck_varlen(device):
    """Fake implementations for thd: out [t_q, h, d_v], LSE [h, t_q]."""
    case = Case(layout="varlen_padded", b=2, s_q=6, s_k=9, d=16, d_v=8, h=2, h_kv=1)
    inputs = make_inputs(case, device)
    q, k, v = (inputs[n].detach().requires_grad_() for n in ("q", "k", "v"))
    seq = [inputs[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q", "seq_offsets_k")]
    fwd_args = (q, k, v, *seq, 6, 9, None, None, 0.25, -1, -1, True, None, None, 0.0, 0.0)
    torch.library.opcheck(flash_attn_fwd, (*fwd_args, None, False))
    out, lse = flash_attn_fwd(*fwd_args, None, False)
    assert out.shape == (q.shape[0], 2, 8) and lse.shape == (2, q.shape[0])
