"""The GPU matrix for `fusedlayers.kernels.flash_attention`, forward and backward.

fp16 and bf16; every head dim in HEAD_DIMS with every (s_q, s_k) in SEQ_PAIRS once (80 cases),
rotating dtype, MHA/GQA/MQA and one feature per case (causal TL/BR, windows, varlen with and
without gaps, dense seqlens, dropout, bias shapes, ALiBi, softcap), so every feature meets
several shapes. Reference: `attention_reference` in fp32 on the GPU; pass rule of
tests/attention_testing.py (2x / 3x PyTorch's error in the input dtype plus one unit).
Then: repeated forwards and deterministic backwards bitwise equal, inputs scaled by 30, s = 1,
a 64k-token sequence checked against a blockwise reference, int64 batch and row offsets past
2^31 elements, and torch.compile(fullgraph=True) over the kernel entry, flash_attn_func and
DotProductAttention.

Set FUSEDLAYERS_GPU_SUMMARY=path to append one JSON line per case (test, case, status, max
errors and PyTorch's errors per tensor, seconds); `python tests/attention_testing.py path`
prints a table from it. Run with `pytest -n 8` (Triton compilation dominates; workers overlap it).
"""

import contextlib
import dataclasses
import json
import os
import time

import pytest
import torch
from attention_testing import (
    Case,
    check_case,
    check_results,
    make_inputs,
    run_kernel,
    run_reference,
)
from fusedlayers.kernels import flash_attention

import fusedlayers

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
CAUSAL = (-1, 0)
HEAD_DIMS = (32, 40, 59, 64, 96, 111, 128, 160, 192, 256)
SEQ_PAIRS = (
    (113, 203),
    (128, 217),
    (108, 256),
    (256, 512),
    (512, 256),
    (1023, 1024),
    (1024, 1023),
    (2048, 2048),
)
HEADS = ((4, 4), (4, 1), (6, 2))  # MHA, MQA, GQA
FEATURES = (
    dict(),
    dict(window=CAUSAL),
    dict(window=CAUSAL, bottom_right=False),
    dict(window=(100, 37)),
    dict(window=(64, 0), bottom_right=False),
    dict(layout="varlen", window=CAUSAL),
    dict(layout="varlen_padded"),
    dict(layout="seqlens", window=CAUSAL),
    dict(dropout_p=0.17),
    dict(dropout_p=0.1, layout="varlen", window=(50, 50)),
    dict(bias="1hss"),
    dict(bias="b1ss", window=CAUSAL),
    dict(bias="bhss"),
    dict(bias="11ss"),
    dict(bias="111s", window=CAUSAL, bottom_right=False),
    dict(alibi="batch", window=CAUSAL),
    dict(alibi="shared"),
    dict(softcap=20.0, softmax_scale=0.15),
    dict(softcap=5.0, window=CAUSAL, layout="varlen"),
)


def _matrix() -> list[Case]:
    """Every head dim x every length pair once. Feature (3i + 7j mod 19), dtype (i + j mod 2) and
    heads (i + 2j mod 3) rotate with the head-dim index i and the length-pair index j, so each
    feature meets four or five different head dims, length pairs and head layouts."""
    cases = []
    for i, d in enumerate(HEAD_DIMS):
        for j, (s_q, s_k) in enumerate(SEQ_PAIRS):
            feature = FEATURES[(3 * i + 7 * j) % len(FEATURES)]
            h, h_kv = HEADS[(i + 2 * j) % len(HEADS)]
            varlen = feature.get("layout", "").startswith("varlen")
            b = 3 if varlen else (2 if s_q < 1000 else 1)
            dtype = (F16, BF16)[(i + j) % 2]
            base = Case(b=b, s_q=s_q, s_k=s_k, h=h, h_kv=h_kv, d=d, dtype=dtype)
            cases.append(dataclasses.replace(base, seed=i * len(SEQ_PAIRS) + j, **feature))
    return cases


MATRIX = _matrix()


def _append_summary(entry: dict) -> None:
    path = os.environ.get("FUSEDLAYERS_GPU_SUMMARY")
    if path:
        # One short line per append: xdist workers can share the file.
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


@contextlib.contextmanager
def recorded(request, case: str):
    """Times the test body and appends its status (and any `entry["errors"]`) to the summary."""
    entry = dict(test=request.node.name, case=case, status="pass", errors={})
    start = time.perf_counter()
    try:
        yield entry
    except pytest.skip.Exception:
        entry["status"] = "skip"
        raise
    except BaseException as exc:
        entry.update(status="fail", message=str(exc)[:800])
        raise
    finally:
        entry["seconds"] = round(time.perf_counter() - start, 2)
        _append_summary(entry)


@pytest.fixture(autouse=True)
def _gpu_hygiene():
    """fp32 references without TF32 (it carries bf16-like error); cached blocks released after
    each test so parallel workers leave room for the big-memory tests."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    torch.cuda.empty_cache()


@pytest.mark.parametrize("case", MATRIX, ids=[c.label() for c in MATRIX])
def test_matrix(case, request):
    with recorded(request, case.label()) as entry:
        entry["errors"] = check_case(case, "cuda", high_dtype=torch.float32)


EXTRA = [
    Case(s_q=1, s_k=1, d=64, dtype=BF16),
    Case(s_q=1, s_k=300, d=128, h=4, h_kv=1, window=CAUSAL),
    Case(s_q=300, s_k=1, d=80, dtype=BF16, window=CAUSAL, bottom_right=False),
    Case(s_q=257, s_k=255, d=8, d_v=64, h=4, h_kv=2, window=CAUSAL),
    Case(s_q=200, s_k=333, d=128, d_v=64, dtype=BF16, bias="1hss", alibi="batch", softcap=10.0),
    Case(s_q=300, s_k=300, d=64, dropout_p=0.3, bias="b1ss", window=(40, 10), dtype=BF16),
]


@pytest.mark.parametrize("case", EXTRA, ids=[c.label() for c in EXTRA])
def test_lengths_one_and_combinations(case, request):
    """s = 1 both ways, d_v != d_qk, and several score features in one case."""
    with recorded(request, case.label()) as entry:
        entry["errors"] = check_case(case, "cuda", high_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_scaled_inputs_stay_finite(dtype, request):
    """q, k, v scaled by 30: huge scores, no inf/NaN; out and LSE under the pass rule.

    Gradients get a bound in units of the dtype only: rows are near one-hot, so dS = P * (dP - D)
    cancels two nearly equal terms and D = rowsum(dO * O) comes from the rounded output
    (FlashAttention-2's choice), which leaves errors of a unit or two of the gradient's magnitude
    (three allowed, the gradient factor of the pass rule; seen on the H100: fp16 0.6, bf16 1.4).
    """
    case = Case(b=2, s_q=500, s_k=700, h=4, h_kv=2, d=96, dtype=dtype, window=CAUSAL)
    with recorded(request, case.label()) as entry:
        inputs = make_inputs(case, "cuda")
        inputs.update({n: inputs[n] * 30 for n in ("q", "k", "v")})
        result = run_kernel(case, inputs)
        for name, t in result.items():
            assert not torch.isnan(t).any(), f"{name}: NaN"
            assert name == "lse" or torch.isfinite(t).all(), f"{name}: inf"
        high = run_reference(case, inputs, torch.float32)
        low = run_reference(case, inputs, case.dtype)
        forward = {n: result[n] for n in ("out", "lse")}
        entry["errors"] = check_results(forward, high, low, case.s_k)
        for name in ("dq", "dk", "dv"):
            error = (result[name].float() - high[name]).abs().max().item()
            magnitude = high[name].abs().max().item()
            bound = 3 * torch.finfo(dtype).eps * magnitude
            entry["errors"][name] = dict(error=error, bound=bound)
            assert error <= bound, f"{name}: error {error:.3e}, magnitude {magnitude:.3e}"


def test_forward_repeats_bitwise(request):
    """100 forwards: out and LSE bitwise identical."""
    case = Case(b=2, s_q=1024, s_k=1024, h=8, h_kv=2, d=128, dtype=BF16, window=CAUSAL)
    with recorded(request, case.label()):
        inputs = make_inputs(case, "cuda")
        first = run_kernel(case, inputs, backward=False)
        for _ in range(99):
            again = run_kernel(case, inputs, backward=False)
            assert torch.equal(again["out"], first["out"]), "out differs"
            assert torch.equal(again["lse"], first["lse"]), "lse differs"


def test_deterministic_backward_repeats_bitwise(request):
    """50 backwards with deterministic=True: dq, dk, dv (GQA sums over heads), dbias identical."""
    case = Case(b=2, s_q=777, s_k=1024, h=8, h_kv=2, d=64, bias="1hss", deterministic=True)
    with recorded(request, case.label()):
        inputs = make_inputs(case, "cuda")
        first = run_kernel(case, inputs)
        for _ in range(49):
            again = run_kernel(case, inputs)
            for name in ("dq", "dk", "dv", "dbias"):
                assert torch.equal(again[name], first[name]), name


def _blockwise_reference(q, k, v, dout, scale, idx, chunk=1024):
    """fp32 causal attention (s_q == s_k) for [1, s, h, d] inputs, never holding s x s scores.

    One pass over query chunks gives out, lse and dq at rows `idx` and dk, dv at key rows `idx`
    (summed over every query). Returns tensors laid out as the kernel's, restricted to `idx`.
    """
    q, k, v, dout = (t.detach()[0].float().transpose(0, 1) for t in (q, k, v, dout))  # [h, s, d]
    h, s, _ = q.shape
    res = dict(out=v.new_zeros(h, s, v.shape[2]), lse=q.new_zeros(h, s), dq=torch.zeros_like(q))
    dk, dv = q.new_zeros(h, len(idx), q.shape[2]), v.new_zeros(h, len(idx), v.shape[2])
    keys = torch.arange(s, device=q.device)
    for start in range(0, s, chunk):
        rows = slice(start, start + chunk)
        scores = q[:, rows] @ k.transpose(1, 2) * scale
        scores.masked_fill_(keys[None, :] > keys[rows, None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores.sub_(lse[..., None]))
        out = p @ v
        dp = dout[:, rows] @ v.transpose(1, 2)
        ds = p * (dp - (dout[:, rows] * out).sum(-1, keepdim=True))
        res["out"][:, rows], res["lse"][:, rows] = out, lse
        res["dq"][:, rows] = ds @ k * scale
        dv += p[:, :, idx].transpose(1, 2) @ dout[:, rows]
        dk += ds[:, :, idx].transpose(1, 2) @ q[:, rows] * scale
    res = {n: t[:, idx] for n, t in res.items()}
    res.update(dk=dk, dv=dv)
    return {n: t if n == "lse" else t.transpose(0, 1) for n, t in res.items()}


@pytest.mark.big_memory
def test_64k_tokens(request):
    """b=1, h=8, d=128, 65536 causal tokens forward+backward: no OOM, no index overflow; rows at
    the start, middle and end match a blockwise fp32 reference."""
    s, h, d = 65536, 8, 128
    case = Case(b=1, s_q=s, s_k=s, h=h, h_kv=h, d=d, dtype=BF16, window=CAUSAL)
    with recorded(request, case.label()) as entry:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (
            torch.randn(1, s, h, d, device="cuda", generator=g, dtype=BF16) for _ in range(4)
        )
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out, lse = flash_attention(*leaves, softmax_scale=d**-0.5, window_size=CAUSAL)
        grads = torch.autograd.grad(out, leaves, dout)
        kernel = dict(out=out.detach(), lse=lse, **dict(zip(("dq", "dk", "dv"), grads)))
        for name, t in kernel.items():
            assert torch.isfinite(t).all(), f"{name}: inf/NaN at 64k tokens"
        idx = torch.cat([torch.arange(a, a + 128) for a in (0, s // 2 - 64, s - 128)]).cuda()
        high = _blockwise_reference(q, k, v, dout, d**-0.5, idx)
        kernel = {n: t[:, :, idx] if n == "lse" else t[:, idx] for n, t in kernel.items()}
        # PyTorch in bf16 = the fp32 result rounded to bf16 (what attention_reference returns for
        # bf16 inputs); the LSE is fp32 either way.
        low = {n: t if n == "lse" else t.to(BF16) for n, t in high.items()}
        high, low = ({n: t.unsqueeze(0) for n, t in r.items()} for r in (high, low))
        entry["errors"] = check_results(kernel, high, low, s)


@pytest.mark.big_memory
def test_int64_offsets(request):
    """q, k, v, out and gradients of 2.15e9 elements: element offsets past 2^31 need int64.
    The last two batch entries (the highest addresses) are checked against the reference."""
    b, s, h, d = 8200, 128, 16, 128
    case = Case(b=2, s_q=s, s_k=s, h=h, h_kv=h, d=d, dtype=BF16, window=CAUSAL)
    with recorded(request, f"b={b},{case.label()}") as entry:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=BF16) for _ in range(3))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out, lse = flash_attention(*leaves, softmax_scale=d**-0.5, window_size=CAUSAL)
        dout = torch.zeros_like(out)
        dout[-2:].normal_()
        grads = torch.autograd.grad(out, leaves, dout)
        kernel = dict(out=out.detach(), lse=lse, **dict(zip(("dq", "dk", "dv"), grads)))
        kernel = {n: t[-2:].clone() for n, t in kernel.items()}
        tail = make_inputs(case, "cuda")
        tail.update(q=q[-2:].detach(), k=k[-2:].detach(), v=v[-2:].detach(), dout=dout[-2:])
        del out, lse, grads, q, k, v, leaves, dout
        high = run_reference(case, tail, torch.float32)
        low = run_reference(case, tail, case.dtype)
        entry["errors"] = check_results(kernel, high, low, s)


@pytest.mark.big_memory
def test_int64_row_offsets(request):
    """sbhd q, k, v, dout seen as [b, s, h, d] views with row stride b * h * d: the last rows of
    every sequence sit past 2^31 elements. The kernels take a block's first row in int64 and the
    rows within it in int32; here the last 64-row block starts past 2^31 too, so a 32-bit block
    origin would wrap as well as 32-bit row offsets. The last two batch entries (every row) are
    checked against the reference."""
    s, b, h, d = 512, 600, 64, 128
    assert (s - 64) * b * h * d > 2**31
    case = Case(b=2, s_q=s, s_k=s, h=h, h_kv=h, d=d, dtype=BF16, window=CAUSAL)
    with recorded(request, f"sbhd b={b},{case.label()}") as entry:
        g = torch.Generator(device="cuda").manual_seed(11)
        sbhd = [
            torch.randn(s, b, h, d, device="cuda", generator=g, dtype=BF16).requires_grad_()
            for _ in range(3)
        ]
        q, k, v = (t.transpose(0, 1) for t in sbhd)
        dout = torch.randn(s, b, h, d, device="cuda", generator=g, dtype=BF16).transpose(0, 1)
        out, lse = flash_attention(q, k, v, softmax_scale=d**-0.5, window_size=CAUSAL)
        grads = [t.transpose(0, 1) for t in torch.autograd.grad(out, sbhd, dout)]
        kernel = dict(out=out.detach(), lse=lse, **dict(zip(("dq", "dk", "dv"), grads)))
        kernel = {n: t[-2:].clone() for n, t in kernel.items()}
        tail = make_inputs(case, "cuda")
        tail.update({n: t[-2:].detach().contiguous() for n, t in dict(q=q, k=k, v=v).items()})
        tail["dout"] = dout[-2:].contiguous()
        del out, lse, grads, q, k, v, sbhd, dout
        high = run_reference(case, tail, torch.float32)
        low = run_reference(case, tail, case.dtype)
        entry["errors"] = check_results(kernel, high, low, s)


def _compile_target(name: str):
    """(function of q, k, v, the q/k/v layout) for one public entry built on the kernels."""
    if name == "kernel_entry":
        return (
            lambda q, k, v: flash_attention(q, k, v, softmax_scale=0.125, window_size=CAUSAL)[0]
        ), "bshd"
    if name == "flash_attn_func":
        return (lambda q, k, v: fusedlayers.flash_attn_func(q, k, v, causal=True)), "bshd"
    module = fusedlayers.DotProductAttention(
        num_attention_heads=8, kv_channels=64, num_gqa_groups=2, qkv_format="sbhd"
    )
    return module.cuda(), "sbhd"


@pytest.mark.parametrize("name", ["kernel_entry", "flash_attn_func", "DotProductAttention"])
def test_torch_compile_fullgraph(name, request):
    """torch.compile(fullgraph=True) (inductor) traces forward and backward with no graph break
    and gives the eager result."""
    with recorded(request, name) as entry:
        fn, layout = _compile_target(name)
        g = torch.Generator(device="cuda").manual_seed(1)
        shapes = [(2, 300, 8, 64), (2, 300, 2, 64), (2, 300, 2, 64)]
        if layout == "sbhd":
            shapes = [(s, b, h, d) for b, s, h, d in shapes]
        tensors = [torch.randn(sh, device="cuda", dtype=BF16, generator=g) for sh in shapes]
        leaves = [t.requires_grad_() for t in tensors]
        compiled = torch.compile(fn, fullgraph=True)
        eager_out, out = fn(*leaves), compiled(*leaves)
        dout = torch.randn_like(out)
        eager_grads = torch.autograd.grad(eager_out, leaves, dout)
        grads = torch.autograd.grad(out, leaves, dout)
        errors = {"out": (out.float() - eager_out.float()).abs().max().item()}
        for n, a, b in zip(("dq", "dk", "dv"), grads, eager_grads):
            errors[n] = (a.float() - b.float()).abs().max().item()
        entry["errors"] = {n: dict(error=e) for n, e in errors.items()}
        # Same kernels on the same inputs: only the surrounding glue may round differently.
        assert max(errors.values()) <= 1e-2, errors
