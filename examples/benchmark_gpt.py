"""Training throughput: the fusedlayers GPT against the same model in plain PyTorch with SDPA.

    python examples/benchmark_gpt.py                      # gpt-125m, context 2048, batch 8, H100
    python examples/benchmark_gpt.py --compile --json runs/bench.json
    python examples/benchmark_gpt.py --json bench/gpt.json      # the run BENCHMARKS.md shows
    python examples/benchmark_gpt.py --variants default,norm-kernels,atomic-dq,both
    python examples/benchmark_gpt.py --batch-size 1 --backward-on-calling-thread
    python examples/benchmark_gpt.py --batch-size 1 --profile-host 3   # where the host's time goes
    python examples/benchmark_gpt.py --fp8                # also FP8 GEMMs (current scaling)
    python examples/benchmark_gpt.py --fp8 delayed        # ... with TE's DelayedScaling

Both models have the same architecture and parameter count (pre-norm RMSNorm, fused QKV, RoPE,
SwiGLU, tied embeddings), run under bf16 autocast with fp32 master weights, and take the same
fused AdamW step on the same random batch. The plain model calls
`F.scaled_dot_product_attention` pinned to the cuDNN backend.

`--backward-on-calling-thread` runs every backward on the training loop's thread instead of
autograd's device thread (docs/performance.md, "The backward on the calling thread"): the
Python of each layer's backward then runs on the core that ran its forward.

`--fp8 [delayed|current|block]` times each fusedlayers model once more with its GEMMs in FP8
(`fusedlayers.fp8_autocast` inside the bf16 autocast, TE's recipe of that name; `current` when
the flag has no value) and reports its speed against the same model in bf16. MFU counts FP8 runs
against the bf16 peak too, so the two compare.

Reported per model: ms/step, tokens/s and model FLOPs utilization, counting
`6 * N + 6 * n_layer * s * d_model` FLOPs per token (N = non-embedding parameters plus the LM
head matmul; the second term is causal attention's QK^T and PV, forward and backward).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from fusedlayers.kernels import _flash_bwd
from fusedlayers.models import GPT, GPTConfig, lm_loss
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as te
from fusedlayers.bench.record import run_header, write_run
from fusedlayers.layers import normalization
from fusedlayers.layers.qkv_storage import QKVSpec, split_fused

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
# Kernels that are off by default, or on only where measured faster (docs/performance.md): each
# variant times the fusedlayers model with some of them switched on everywhere, for the A/B.
VARIANTS = {
    "default": dict(norm_kernels=False, atomic_dq=False),
    "norm-kernels": dict(norm_kernels=True, atomic_dq=False),
    "atomic-dq": dict(norm_kernels=False, atomic_dq=True),
    "both": dict(norm_kernels=True, atomic_dq=True),
}

# --fp8: TE's recipes by name (delayed: TE's tutorial settings).
FP8_RECIPES = {
    "delayed": lambda: te.recipe.DelayedScaling(amax_history_len=16, amax_compute_algo="max"),
    "current": te.recipe.Float8CurrentScaling,
    "block": te.recipe.Float8BlockScaling,
}


@contextlib.contextmanager
def switched(norm_kernels: bool, atomic_dq: bool):
    """Turn the off-by-default kernels on for the duration of a benchmark."""
    saved = normalization.KERNEL_MIN_HIDDEN, _flash_bwd.ATOMIC_DQ_DEVICES
    # norm_kernels: at every hidden size; otherwise the library's default threshold.
    normalization.KERNEL_MIN_HIDDEN = 0 if norm_kernels else saved[0]
    _flash_bwd.ATOMIC_DQ_DEVICES = "cuda" if atomic_dq else "never"
    try:
        yield
    finally:
        normalization.KERNEL_MIN_HIDDEN, _flash_bwd.ATOMIC_DQ_DEVICES = saved


class PlainBlock(torch.nn.Module):
    """Pre-norm block: x [b, s, d] -> x + attn(norm(x)) -> + swiglu_mlp(norm(.))."""

    def __init__(self, c: GPTConfig, sdpa_backend: SDPBackend) -> None:
        super().__init__()
        self.c, self.sdpa_backend = c, sdpa_backend
        kv = c.n_kv_head * c.head_dim
        self.norm1 = torch.nn.RMSNorm(c.d_model, eps=c.layernorm_epsilon)
        self.qkv = torch.nn.Linear(c.d_model, c.d_model + 2 * kv, bias=False)
        self.proj = torch.nn.Linear(c.d_model, c.d_model, bias=False)
        self.norm2 = torch.nn.RMSNorm(c.d_model, eps=c.layernorm_epsilon)
        self.fc1 = torch.nn.Linear(c.d_model, 2 * c.d_ff, bias=False)
        self.fc2 = torch.nn.Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, (b, s, _) = self.c, x.shape
        kv = c.n_kv_head * c.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([c.d_model, kv, kv], dim=-1)
        q = _rope(q.view(b, s, c.n_head, c.head_dim), cos, sin).transpose(1, 2)  # [b, h, s, d]
        k = _rope(k.view(b, s, c.n_kv_head, c.head_dim), cos, sin).transpose(1, 2)
        v = v.view(b, s, c.n_kv_head, c.head_dim).transpose(1, 2)
        with sdpa_kernel(self.sdpa_backend):
            a = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=c.n_kv_head != c.n_head
            )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, c.d_model))
        gate, up = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on t [b, s, h, d] with cos/sin [s, 1, d] (fp32), returned in t's dtype."""
    first, second = t.float().chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (t.float() * cos + rotated * sin).to(t.dtype)


class PlainGPT(torch.nn.Module):
    """The GPT of `fusedlayers.models` written with torch.nn modules and SDPA: idx [b, s] ->
    logits [b, s, V] fp32. Only the configuration the benchmark uses is supported."""

    def __init__(self, c: GPTConfig, sdpa_backend: SDPBackend = SDPBackend.CUDNN_ATTENTION) -> None:
        super().__init__()
        arch = (c.pos_emb, c.normalization, c.activation, c.tie_embeddings, c.bias)
        if arch != ("rope", "RMSNorm", "swiglu", True, False):
            raise ValueError(f"PlainGPT implements RoPE/RMSNorm/SwiGLU/tied/no-bias, got {arch}")
        self.c = c
        self.tok_emb = torch.nn.Embedding(c.vocab_size, c.d_model)
        self.layers = torch.nn.ModuleList(PlainBlock(c, sdpa_backend) for _ in range(c.n_layer))
        self.final_norm = torch.nn.RMSNorm(c.d_model, eps=c.layernorm_epsilon)
        inv_freq = 1.0 / c.rope_base ** (torch.arange(0, c.head_dim, 2) / c.head_dim)
        angles = torch.outer(torch.arange(c.context_length).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [s, 1, d]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x, self.cos[:s], self.sin[:s])
        return F.linear(self.final_norm(x), self.tok_emb.weight).float()


def copy_from_fused(plain: PlainGPT, gpt: GPT) -> None:
    """Load the fusedlayers GPT's weights into `plain`, so both benchmark the same function
    (TE's interleaved fused QKV rows are regrouped into plain [q | k | v])."""
    c, src = gpt.config, gpt.state_dict()
    spec = QKVSpec(
        ("query", "key", "value"), (c.n_head, c.n_kv_head, c.n_kv_head), c.n_kv_head, c.head_dim
    )
    dst = {"tok_emb.weight": src["tok_emb.weight"], "final_norm.weight": src["final_norm.weight"]}
    for i in range(c.n_layer):
        fused, plain_prefix = f"layers.{i}.", f"layers.{i}."
        qkv = src[fused + "self_attention.layernorm_qkv.weight"]
        dst |= {
            plain_prefix + "norm1.weight": src[
                fused + "self_attention.layernorm_qkv.layer_norm_weight"
            ],
            plain_prefix + "qkv.weight": torch.cat(split_fused(qkv, spec, "interleaved")),
            plain_prefix + "proj.weight": src[fused + "self_attention.proj.weight"],
            plain_prefix + "norm2.weight": src[fused + "layernorm_mlp.layer_norm_weight"],
            plain_prefix + "fc1.weight": src[fused + "layernorm_mlp.fc1_weight"],
            plain_prefix + "fc2.weight": src[fused + "layernorm_mlp.fc2_weight"],
        }
    plain.load_state_dict(dst)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt-125m")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--formats", default="bshd", help="comma-separated attn_input_formats")
    p.add_argument(
        "--variants",
        default="default",
        help=f"comma-separated fusedlayers variants to time: {', '.join(VARIANTS)}",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile every model")
    p.add_argument(
        "--fp8",
        nargs="?",
        const="current",
        choices=sorted(FP8_RECIPES),
        default=None,
        help="also time the fusedlayers models with FP8 GEMMs under this TE recipe",
    )
    p.add_argument(
        "--backward-on-calling-thread",
        action="store_true",
        help="run each backward on the training loop's thread instead of autograd's device "
        "thread (torch.autograd.set_multithreading_enabled(False)), for every model",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="default: by GPU name")
    p.add_argument("--json", type=Path, default=None, help="also write the run here (kind gpt)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        help="after timing, profile this many steps per model and print the top GPU kernels",
    )
    p.add_argument(
        "--profile-host",
        type=int,
        default=0,
        help="after timing, profile this many steps per model and print where the host's time "
        "goes: per module class, per autograd node and per op, with launches per step",
    )
    return p.parse_args()


def flops_per_token(model: torch.nn.Module, c: GPTConfig) -> float:
    """6N + 6 * n_layer * s * d (see the module docstring); N counts the tied LM head once."""
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 6 * c.n_layer * c.context_length * c.d_model


def bench(
    model: torch.nn.Module, c: GPTConfig, args: argparse.Namespace, fp8_recipe=None
) -> dict[str, float]:
    """Warm up, then time `steps` full training steps (forward, backward, fused AdamW); with
    `fp8_recipe` the fusedlayers layers' GEMMs run in FP8."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_fn = torch.compile(model) if args.compile else model
    gen = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(
        0, c.vocab_size, (args.batch_size, c.context_length + 1), device="cuda", generator=gen
    )
    x, y = idx[:, :-1], idx[:, 1:]

    def step() -> torch.Tensor:
        fp8 = te.fp8_autocast(fp8_recipe=fp8_recipe) if fp8_recipe else contextlib.nullcontext()
        with torch.autocast("cuda", dtype=torch.bfloat16), fp8:
            loss = lm_loss(step_fn(x), y)
        with torch.autograd.set_multithreading_enabled(not args.backward_on_calling_thread):
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first_loss = step().item()
    for _ in range(args.warmup - 1):
        loss = step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / args.steps
    tokens = args.batch_size * c.context_length / seconds
    peak = args.peak_tflops or next(
        (v for k, v in PEAK_BF16_TFLOPS.items() if k in torch.cuda.get_device_name()), 989.4
    )
    return (
        {
            "ms_per_step": seconds * 1e3,
            "tokens_per_s": tokens,
            "mfu": tokens * flops_per_token(model, c) / (peak * 1e12),
            "first_loss": first_loss,
            "final_loss": loss.item(),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        | (profile_steps(step, args.profile) if args.profile else {})
        | (profile_host(model, step, args.profile_host) if args.profile_host else {})
    )


def profile_steps(step, steps: int, top: int = 25) -> dict[str, float]:
    """Print the `top` GPU kernels by total time over `steps` steps; return the GPU's busy time
    per step next to the wall time (busy well under wall means the host is the bottleneck)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70))
    # Device-side entries only (kernels, copies): an operator's row repeats its kernels' time.
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    print(f"GPU busy {busy:.1f} ms per step of {wall * 1e3:.1f} ms wall (profiled)")
    return {"profiled_gpu_busy_ms": busy, "profiled_wall_ms": wall * 1e3}


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def profile_host(model: torch.nn.Module, step, steps: int, top: int = 40) -> dict[str, float]:
    """Print the host's time per step by module class (forward only: "module: <class>"), by
    autograd node (each layer's backward, "autograd::engine::evaluate_function: ...") and by op,
    totals over every layer, and return the kernel launches per step. A host-bound step (small
    batch) spends its wall time here rather than on the GPU."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    scopes, handles = [], []  # forward hooks nest, so the open scopes form a stack

    def enter(module, _args):
        scopes.append(record_function(f"module: {type(module).__name__}"))
        scopes[-1].__enter__()

    def leave(_module, _args, _output):
        scopes.pop().__exit__(None, None, None)

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            wall = (time.perf_counter() - start) / steps
    finally:
        for handle in handles:
            handle.remove()
    events = prof.key_averages()
    print(events.table(sort_by="cpu_time_total", row_limit=top, max_name_column_width=90))
    launches = sum(e.count for e in events if e.key in LAUNCHES) / steps
    print(f"{launches:.0f} kernel launches per step, {wall * 1e3:.1f} ms wall (profiled)")
    return {"launches_per_step": launches, "host_profiled_wall_ms": wall * 1e3}


def build_models(c: GPTConfig, formats: list[str]) -> dict[str, torch.nn.Module]:
    """One fusedlayers GPT per attn_input_format and the plain model, all with equal weights."""
    torch.manual_seed(0)
    first = GPT(dataclasses.replace(c, attn_input_format=formats[0])).cuda()
    models = {f"fusedlayers[{formats[0]}]": first}
    for fmt in formats[1:]:
        model = GPT(dataclasses.replace(c, attn_input_format=fmt)).cuda()
        model.load_state_dict(first.state_dict())
        models[f"fusedlayers[{fmt}]"] = model
    models["pytorch_sdpa_cudnn"] = PlainGPT(c).cuda()
    copy_from_fused(models["pytorch_sdpa_cudnn"], first)
    return models


def main() -> None:
    args = parse_args()
    c = GPTConfig.named(args.config, context_length=args.context_length)
    results = {}
    for name, model in build_models(c, args.formats.split(",")).items():
        # Same initial weights and batch: the final losses should agree to bf16 noise.
        variants = args.variants.split(",") if name.startswith("fusedlayers") else ["default"]
        # Every variant starts from the same weights (bench trains the model it is given).
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for variant in variants:
            label = name if variant == "default" else f"{name}+{variant}"
            model.load_state_dict(initial)
            restored = model.state_dict()
            stale = [
                k
                for k, v in initial.items()  # `_extra_state`: FP8 metadata, not weights
                if not k.endswith("_extra_state") and not torch.equal(restored[k], v)
            ]
            if stale:
                raise SystemExit(f"{label}: load_state_dict left {len(stale)} tensors: {stale[:5]}")
            with switched(**VARIANTS[variant]):
                results[label] = bench(model, c, args)
            results[label]["parameters"] = sum(p.numel() for p in model.parameters())
        if args.fp8 and name.startswith("fusedlayers"):
            model.load_state_dict(initial)
            label = f"{name}+fp8-{args.fp8}"
            results[label] = bench(model, c, args, FP8_RECIPES[args.fp8]())
            results[label]["parameters"] = sum(p.numel() for p in model.parameters())
            bf16 = results[name]["tokens_per_s"]
            results[label]["vs_bf16"] = results[label]["tokens_per_s"] / bf16
        model.cpu()
        torch.cuda.empty_cache()
    plain = results["pytorch_sdpa_cudnn"]
    sizes = {r["parameters"] for r in results.values()}
    if len(sizes) != 1:
        raise SystemExit(f"models differ in size: {sizes}")
    print(
        f"{torch.cuda.get_device_name()}, {args.config} ({plain['parameters'] / 1e6:.1f}M), "
        f"batch {args.batch_size} x {c.context_length}, compile={args.compile}, "
        f"{args.warmup} warm-up + {args.steps} timed steps"
    )
    print(
        "| model | ms/step | tokens/s | MFU | vs plain | peak mem GiB | first loss | final loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
            f"{r['tokens_per_s'] / plain['tokens_per_s']:.3f}x | {r['peak_mem_gib']:.1f} | "
            f"{r['first_loss']:.4f} | {r['final_loss']:.4f} |"
        )
    for name, r in results.items():
        if "vs_bf16" in r:
            print(f"{name}: {r['vs_bf16']:.3f}x the tokens/s of the same model in bf16")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        write_run(args.json, "gpt", run_header(config=config), result_rows(results, args))


def result_rows(results: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    """One row per timed model for the run's JSON (fusedlayers.bench.record, kind gpt): the
    measurements and what the report groups them by (mode, batch, where the backward ran)."""
    return [
        {
            "model": name,
            "provider": "plain" if name == "pytorch_sdpa_cudnn" else "fusedlayers",
            "fp8": name.rpartition("+fp8-")[2] if "+fp8-" in name else None,
            "mode": "compiled" if args.compile else "eager",
            "config": args.config,
            "batch_size": args.batch_size,
            "context_length": args.context_length,
            "backward_on_calling_thread": args.backward_on_calling_thread,
            **r,
        }
        for name, r in results.items()
    ]


if __name__ == "__main__":
    main()
