"""Per-rank bodies of the context-parallel tests (spawned by `distributed_testing.run_on_ranks`).

Every rank builds the same full-sequence inputs from one seed, computes the oracle (the fp64
reference on the full sequences, in this one process), runs context-parallel attention on its
own slice, and reports the max error of its outputs and gradients against the oracle's rows
for that slice. For low-precision runs it also reports PyTorch's own error (the reference fed
the low-precision inputs, on the full sequence), for the pass rule "at most 2x (outputs) or 3x
(gradients) PyTorch's error plus a small atol".

Legend: dense full tensors are bshd [b, S, h, d]; thd full tensors are [T, h, d] with
`seqlens` the full sequence lengths. Local tensors are in the case's qkv_format.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import torch
import torch.distributed as dist
from fusedlayers.models import GPT, GPTConfig
from repeat_testing import grads_of, run_sequence

import fusedlayers.attention.reference as reference_module
from fusedlayers import DotProductAttention
from fusedlayers.attention.context_parallel import (
    context_parallel_attention,
    context_parallel_indices,
)
from fusedlayers.attention.reference import attention_reference
from fusedlayers.layers.rope import RotaryPositionEmbedding
from fusedlayers.layers.transformer_layer import TransformerLayer

GRADS = ("dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class CPCase:
    qkv_format: str = "bshd"
    mask: str = "causal"
    heads: int = 4
    kv_heads: int = 2
    d: int = 8
    d_v: int = 8
    b: int = 2
    s: int = 24  # full length, dense formats
    seqlens: tuple[int, ...] = (8, 24, 16)  # full lengths, thd (multiples of 2 * cp)
    dtype: str = "float64"
    backend: str = "reference"  # "kernel": the Triton kernels (interpreter on CPU)
    module: bool = True  # through DotProductAttention (else the functional entry)
    seed: int = 0
    high: str = "float64"  # the oracle's dtype (GPU: float32)
    # PyTorch's own error computed with the attention math in the input dtype (the GPU rule)
    # rather than the reference's fp32 math on input-dtype tensors
    pytorch_in_dtype: bool = False
    cp_stream: bool = False  # merge on a second CUDA stream
    deterministic: bool = False

    @property
    def causal(self) -> bool:
        return "causal" in self.mask

    def __str__(self) -> str:
        kind = "module" if self.module else "function"
        return (
            f"{self.qkv_format}-{self.mask}-h{self.heads}g{self.kv_heads}-{self.dtype}-"
            f"{self.backend}-{kind}"
        )


def _full_inputs(case: CPCase, device):
    gen = torch.Generator().manual_seed(case.seed)
    lead = (sum(case.seqlens),) if case.qkv_format == "thd" else (case.b, case.s)

    def rand(heads, d):
        return torch.randn(*lead, heads, d, generator=gen, dtype=torch.float64).to(device)

    return (
        rand(case.heads, case.d),
        rand(case.kv_heads, case.d),
        rand(case.kv_heads, case.d_v),
        rand(case.heads, case.d_v),  # dout
    )


def _cu(seqlens, device) -> torch.Tensor:
    values = [0]
    for n in seqlens:
        values.append(values[-1] + n)
    return torch.tensor(values, dtype=torch.int32, device=device)


def _oracle(case: CPCase, q, k, v, dout, dtype, in_dtype_math: bool = False):
    """out and (dq, dk, dv) of the full sequences in the reference path, inputs cast to dtype
    (`in_dtype_math`: the reference computes in that dtype too)."""
    if in_dtype_math:
        with mock.patch.object(reference_module, "_compute_dtype", lambda dtype: dtype):
            return _oracle(case, q, k, v, dout, dtype)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    cu = _cu(case.seqlens, q.device) if case.qkv_format == "thd" else None
    out = attention_reference(
        *leaves,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        window_size=(-1, 0) if case.causal else (-1, -1),
        bottom_right=False,
    )
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return out.detach(), grads


def _local(t: torch.Tensor, case: CPCase, index: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a full tensor, in the case's qkv_format."""
    if case.qkv_format == "thd":
        return t[index]
    t = t[:, index]
    return t.transpose(0, 1).contiguous() if case.qkv_format == "sbhd" else t


def _as_full_layout(t: torch.Tensor, case: CPCase) -> torch.Tensor:
    return t.transpose(0, 1) if case.qkv_format == "sbhd" else t


def _run_local(case: CPCase, group, q, k, v, dout):
    """Context-parallel out [..., h, d_v] and gradients of this rank's slice."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    options = {}
    if case.qkv_format == "thd":
        options["cu_seqlens_q"] = options["cu_seqlens_kv"] = _cu(case.seqlens, q.device)
    if case.module:
        attn = DotProductAttention(
            case.heads,
            (case.d, case.d_v),
            num_gqa_groups=case.kv_heads,
            qkv_format=case.qkv_format,
            attn_mask_type=case.mask,
            cp_group=group,
            cp_stream=torch.cuda.Stream() if case.cp_stream else None,
            use_reference=case.backend == "reference",
            deterministic=case.deterministic,
        )
        out = attn(q, k, v, **options)
        out = out.view(*out.shape[:-1], case.heads, case.d_v)
    else:
        out = context_parallel_attention(
            q,
            k,
            v,
            cp_group=group,
            qkv_format=case.qkv_format,
            attn_mask_type=case.mask,
            backend=case.backend,
            **options,
        )
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), grads


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max error relative to the reference's largest magnitude (at least 1)."""
    return _max_error(a, b) / max(b.abs().max().item(), 1.0)


def run_case(rank: int, world: int, case: CPCase) -> dict:
    """Errors of this rank's slice: {name: (error, PyTorch's error in the case dtype)}."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dtype = getattr(torch, case.dtype)
    q, k, v, dout = _full_inputs(case, device)
    seqlens = case.seqlens if case.qkv_format == "thd" else [case.s]
    index = context_parallel_indices(list(seqlens), world, rank, device)
    high_out, high_grads = _oracle(case, q, k, v, dout, getattr(torch, case.high))
    low_out, low_grads = _oracle(case, q, k, v, dout, dtype, case.pytorch_in_dtype)
    local = [_local(t, case, index).to(dtype) for t in (q, k, v, dout)]
    out, grads = _run_local(case, dist.group.WORLD, *local)
    rows = lambda t: _local(t, case, index)  # noqa: E731
    report = {}
    for name, got, high, low in zip(
        ("out", *GRADS), (out, *grads), (high_out, *high_grads), (low_out, *low_grads)
    ):
        high = rows(high)
        report[name] = dict(
            error=_max_error(_as_full_layout(got, case), _as_full_layout(high, case)),
            pytorch_error=_max_error(rows(low), high),
            magnitude=high.abs().max().item(),
        )
    return report


def run_cases(rank: int, world: int, cases: list[CPCase]) -> list[dict]:
    """`run_case` for each case, in one process group."""
    return [run_case(rank, world, case) for case in cases]


def run_layer_case(rank: int, world: int, qkv_format: str) -> dict:
    """A causal GQA TransformerLayer with RoPE, fp64 reference path: this rank's output and
    input gradient, and the parameter gradients summed over ranks, against one process running
    the full sequences. Returns {name: max error relative to the largest magnitude}."""
    torch.manual_seed(0)
    layer = TransformerLayer(
        32,
        64,
        4,
        num_gqa_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attn_input_format=qkv_format,
        params_dtype=torch.float64,
        use_reference=True,
    )
    seqlens = [8, 16] if qkv_format == "thd" else [16]
    gen = torch.Generator().manual_seed(1)
    lead = (sum(seqlens),) if qkv_format == "thd" else (2, 16)
    x, dout = (torch.randn(*lead, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    if qkv_format == "sbhd":
        x, dout = x.transpose(0, 1).contiguous(), dout.transpose(0, 1).contiguous()
    options = dict(rotary_pos_emb=RotaryPositionEmbedding(8)(max(seqlens)))
    if qkv_format == "thd":
        options.update(cu_seqlens_q=_cu(seqlens, "cpu"), max_seqlen_q=max(seqlens))

    def run(x, dout):
        x = x.detach().requires_grad_()
        layer.zero_grad()
        y = layer(x, **options)
        y.backward(dout)
        return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    full_y, full_dx, full_dp = run(x, dout)
    index = context_parallel_indices(seqlens, world, rank)
    dim = 1 if qkv_format == "bshd" else 0
    pick = lambda t: t.index_select(dim, index)  # noqa: E731
    layer.set_context_parallel_group(dist.group.WORLD, list(range(world)))
    y, dx, dp = run(pick(x), pick(dout))
    report = {"out": _relative_error(y, pick(full_y)), "dx": _relative_error(dx, pick(full_dx))}
    for name, grad in dp.items():
        dist.all_reduce(grad)  # each rank holds its tokens' share of every parameter gradient
        report[name] = _relative_error(grad, full_dp[name])
    return report


def run_gpt_case(rank: int, world: int, pos_emb: str, qkv_format: str) -> dict:
    """A small GPT split over the group (`set_context_parallel_group`): this rank's logits, and
    the parameter gradients summed over ranks, against the full sequences in one process."""
    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        context_length=32,
        pos_emb=pos_emb,
        attn_input_format=qkv_format,
    )
    model = GPT(config, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
    weight = torch.randn(2, 16, config.vocab_size, generator=gen, dtype=torch.float64)

    def run(idx, weight):
        model.zero_grad()
        logits = model(idx)
        (logits * weight).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    full_logits, full_grads = run(idx, weight)
    index = context_parallel_indices([16], world, rank)
    model.set_context_parallel_group(dist.group.WORLD)
    logits, grads = run(idx[:, index], weight[:, index])
    report = {"logits": _relative_error(logits, full_logits[:, index])}
    for name, grad in grads.items():
        dist.all_reduce(grad)
        report[name] = _relative_error(grad, full_grads[name])
    return report


def run_layer_cases(rank: int, world: int, formats: list[str]) -> dict[str, dict]:
    """`run_layer_case` per format and `run_gpt_case` for RoPE/sbhd and learned/thd."""
    reports = {f"layer-{f}": run_layer_case(rank, world, f) for f in formats}
    for pos_emb, fmt in (("rope", "sbhd"), ("learned", "thd")):
        reports[f"gpt-{pos_emb}-{fmt}"] = run_gpt_case(rank, world, pos_emb, fmt)
    return reports


def run_repeats(rank: int, world: int, cases: list[CPCase], order: str) -> list[dict]:
    """Context-parallel `DotProductAttention` calls along `repeat_testing.SEQUENCES[order]`:
    signature "A" is `cases[0]`, "B" `cases[1]`, each with one module and one set of local leaf
    tensors for all its calls (as a training loop or a benchmark reuses them). Returns one
    `run_case`-style report per call, for the outputs and, on calls with grad, the gradients."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    setups = {}
    for name, case in zip("AB", cases):
        dtype = getattr(torch, case.dtype)
        q, k, v, dout = _full_inputs(case, device)
        seqlens = case.seqlens if case.qkv_format == "thd" else [case.s]
        index = context_parallel_indices(list(seqlens), world, rank, device)
        high = _oracle(case, q, k, v, dout, getattr(torch, case.high))
        low = _oracle(case, q, k, v, dout, dtype, case.pytorch_in_dtype)
        local = [_local(t, case, index).to(dtype) for t in (q, k, v, dout)]
        leaves = tuple(t.detach().requires_grad_() for t in local[:3])
        options = {}
        if case.qkv_format == "thd":
            options["cu_seqlens_q"] = options["cu_seqlens_kv"] = _cu(case.seqlens, device)
        if case.module:
            attn = DotProductAttention(
                case.heads, (case.d, case.d_v), num_gqa_groups=case.kv_heads,
                qkv_format=case.qkv_format, attn_mask_type=case.mask, cp_group=dist.group.WORLD,
                cp_stream=torch.cuda.Stream() if case.cp_stream else None,
                use_reference=case.backend == "reference",
            )  # fmt: skip
        else:  # the functional entry, which takes `backend` ("kernel" on a CPU: interpreter)
            options.update(
                cp_group=dist.group.WORLD, qkv_format=case.qkv_format,
                attn_mask_type=case.mask, backend=case.backend,
            )  # fmt: skip
            attn = context_parallel_attention
        setups[name] = (case, attn, leaves, local[3], options, index, high, low)
    reports = []

    def run(signature, mode):
        case, attn, leaves, dout, options, *_ = setups[signature]
        out = attn(*leaves, **options)
        if case.module:  # [..., h * d_v] -> [..., h, d_v], as the functional entry returns
            out = out.view(*out.shape[:-1], case.heads, case.d_v)
        return out, grads_of(out, leaves, dout, mode)

    def check(signature, mode, i, result):
        case, *_, index, high, low = setups[signature]
        rows = lambda t: _local(t, case, index)  # noqa: E731
        names = ("out", *GRADS) if result[1] is not None else ("out",)
        got = (result[0].detach(), *(result[1] or ()))
        report = {}
        for name, g, h, lo in zip(names, got, (high[0], *high[1]), (low[0], *low[1])):
            h = rows(h)
            report[f"call {i} ({signature}, {mode}) {name}"] = dict(
                error=_max_error(_as_full_layout(g, case), _as_full_layout(h, case)),
                pytorch_error=_max_error(rows(lo), h),
                magnitude=h.abs().max().item(),
            )
        reports.append(report)

    run_sequence(run, check, order)
    return reports


def run_twice_bitwise(rank: int, world: int, case: CPCase) -> bool:
    """Whether two runs of `case` give bitwise equal outputs and gradients on this rank."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    q, k, v, dout = _full_inputs(case, device)
    seqlens = case.seqlens if case.qkv_format == "thd" else [case.s]
    index = context_parallel_indices(list(seqlens), world, rank, device)
    local = [_local(t, case, index).to(getattr(torch, case.dtype)) for t in (q, k, v, dout)]
    first, second = (_run_local(case, dist.group.WORLD, *local) for _ in range(2))
    pairs = [(first[0], second[0]), *zip(first[1], second[1])]
    return all(torch.equal(a, b) for a, b in pairs)
