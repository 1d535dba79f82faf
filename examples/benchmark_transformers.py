"""Training a Hugging Face Llama on attn_implementation="sdpa" and "fusedlayers", side by side.

    python examples/benchmark_transformers.py                  # Llama 3.2 1B-like, 8 x 4096, GPU
    python examples/benchmark_transformers.py --padding        # right-padded batches (varlen)
    python examples/benchmark_transformers.py --compile --json runs/hf.json
    python examples/benchmark_transformers.py --layers 4 --vocab 32000 --repeat-sdpa
    python examples/benchmark_transformers.py --tiny           # CPU smoke run (fp32, 3 steps)

What a transformers user gets: a `LlamaForCausalLM` built from its config with random weights
(nothing is downloaded; Llama 3.2 1B's shape: hidden 2048, 16 layers, 32 query heads over 8 KV
heads, head dim 64, MLP 8192, vocabulary 128256, RoPE theta 500000 without Llama 3's frequency
scaling, tied embeddings), trained the way a plain HF-Trainer-like loop with `--bf16` weights
does: weights held in bf16 (`dtype=torch.bfloat16`, no fp32 master copy, no autocast) and
AdamW, fused on CUDA. The model's own loss is used (labels = input_ids; padding labelled -100).

Both implementations run in this one process from the same initial weights (a state_dict
snapshot loaded before each run) on the same random token batches (fixed seed). Reported per
run: ms/step over the timed steps (each step synchronized, median and mean), tokens/s (every
position of the batch, padding included), peak CUDA memory, and the loss at every step; then
fusedlayers' speedup over sdpa and the largest |loss difference| / loss over all steps. Whether
that difference is within bf16 noise is left to the reader: `--repeat-sdpa` runs sdpa a second
time to show its own run-to-run difference (zero where every kernel is deterministic).

Without CUDA the script runs on the CPU, where "fusedlayers" takes its PyTorch reference path:
a pipeline check (`--tiny`), not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from fusedlayers.bench.record import run_header, write_run

# Llama 3.2 1B's shape; --tiny swaps in a model and batch the CPU runs in seconds.
FULL = dict(
    layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
    vocab=128256, rope_theta=500000.0, batch_size=8, seq_len=4096, warmup=3, steps=20,
)  # fmt: skip
TINY = dict(
    layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
    vocab=256, batch_size=2, seq_len=32, warmup=1, steps=2, dtype="fp32",
)  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small model and batch (CPU smoke run)")
    for name, value in FULL.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="weights and activations")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0, help="weights and batches")
    p.add_argument(
        "--padding",
        action="store_true",
        help="right-pad each sequence to a random length with an attention_mask (varlen)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument(
        "--repeat-sdpa", action="store_true", help="run sdpa twice: its own run-to-run noise"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the run here")
    args = p.parse_args(argv)
    if args.tiny:  # the preset replaces the defaults only: explicit flags still win
        p.set_defaults(**TINY)
        args = p.parse_args(argv)
    return args


def build_model(args: argparse.Namespace, device: str) -> torch.nn.Module:
    """A randomly initialized LlamaForCausalLM of the requested shape, on `device`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.seq_len, 8192),
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=True,
        use_cache=False,  # training: no KV cache to build
    )
    torch.manual_seed(args.seed)
    # Initialized on the device itself: a 1B model's random init on the CPU takes a while.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[args.dtype], attn_implementation="sdpa"
        )
    return model.train()


def make_batches(args: argparse.Namespace, device: str) -> list[dict[str, torch.Tensor]]:
    """One batch per step, warm-up included, drawn once so that every run sees the same ones."""
    gen = torch.Generator().manual_seed(args.seed)
    b, s = args.batch_size, args.seq_len
    batches = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, args.vocab, (b, s), generator=gen)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if args.padding:
            # Lengths from a quarter to all of the sequence: right padding is served by the
            # per-sequence-length (varlen) route, not a dense mask.
            lengths = torch.randint(max(1, s // 4), s + 1, (b,), generator=gen)
            mask = torch.arange(s)[None, :] < lengths[:, None]
            batch["input_ids"] = ids.masked_fill(~mask, 0)
            batch["labels"] = ids.masked_fill(~mask, -100)  # no loss on padding
            batch["attention_mask"] = mask.long()
        batches.append({k: v.to(device) for k, v in batch.items()})
    return batches


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train(model, name, initial, batches, args, device) -> dict:
    """Load `initial`, switch to attention `name`, train on `batches`, time the last `steps`."""
    model.load_state_dict(initial)
    model.set_attn_implementation(name)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device == "cuda")
    if args.compile:
        torch._dynamo.reset()  # the previous run's graphs were traced on the other attention
    forward = torch.compile(model) if args.compile else model
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses, step_ms = [], []
    for i, batch in enumerate(batches):
        sync(device)
        start = time.perf_counter()
        loss = forward(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step's kernels; sync() covers the rest
        sync(device)
        if i >= args.warmup:
            step_ms.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(step_ms)
    result = {
        "attn_implementation": name,
        "ms_per_step_median": median,
        "ms_per_step_mean": statistics.fmean(step_ms),
        "tokens_per_s": args.batch_size * args.seq_len / median * 1e3,
        "step_ms": step_ms,
        "losses": losses,
    }
    if device == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del opt, forward  # the optimizer state of this run is not the next run's memory
    return result


def max_rel_diff(a: list[float], b: list[float]) -> float:
    """max over steps of |a - b| / |b|: how far two runs' losses drift apart."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import transformers

    from fusedlayers.integrations.transformers import register

    register()  # attn_implementation="fusedlayers"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args, device)
    # The snapshot lives on the CPU so that it does not count in either run's peak memory.
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    batches = make_batches(args, device)
    runs = {"sdpa": "sdpa", "fusedlayers": "fusedlayers"}
    if args.repeat_sdpa:
        runs["sdpa-repeat"] = "sdpa"
    results = [
        {"run": run} | train(model, name, initial, batches, args, device)
        for run, name in runs.items()
    ]
    sdpa, fused = results[0], results[1]
    summary = {
        "speedup_vs_sdpa": sdpa["ms_per_step_median"] / fused["ms_per_step_median"],
        "max_rel_loss_diff_vs_sdpa": max_rel_diff(fused["losses"], sdpa["losses"]),
    }
    if args.repeat_sdpa:
        summary["max_rel_loss_diff_sdpa_repeat"] = max_rel_diff(
            results[2]["losses"], sdpa["losses"]
        )

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (not a measurement)"
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{where}, Llama {params / 1e6:.1f}M params, {args.dtype} weights, batch "
        f"{args.batch_size} x {args.seq_len}{' padded' if args.padding else ''}, "
        f"compile={args.compile}, {args.warmup} warm-up + {args.steps} timed steps"
    )
    print("| run | ms/step median | ms/step mean | tokens/s | peak mem GiB |")
    print("|---|---|---|---|---|")
    for r in results:
        mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
        print(
            f"| {r['run']} | {r['ms_per_step_median']:.1f} | "
            f"{r['ms_per_step_mean']:.1f} | {r['tokens_per_s']:,.0f} | {mem} |"
        )
    print("\n| step | " + " | ".join(r["run"] for r in results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for i in range(len(batches)):
        label = f"{i + 1}" + (" (warm-up)" if i < args.warmup else "")
        print(f"| {label} | " + " | ".join(f"{r['losses'][i]:.5f}" for r in results) + " |")
    print(f"\nfusedlayers vs sdpa: {summary['speedup_vs_sdpa']:.3f}x (median ms/step)")
    print(f"max |loss diff| / loss over all steps: {summary['max_rel_loss_diff_vs_sdpa']:.2e}")
    if args.repeat_sdpa:
        print(f"  sdpa against itself: {summary['max_rel_loss_diff_sdpa_repeat']:.2e}")

    if args.json is None:
        return {"header": {}, "rows": results, "summary": summary}
    config = {k: v for k, v in vars(args).items() if k != "json"} | {"parameters": params}
    header = run_header(
        config=config, transformers=transformers.__version__, summary=summary, device=device
    )
    rows = [
        {"mode": "compiled" if args.compile else "eager", "padding": args.padding, **r}
        for r in results
    ]
    return write_run(args.json, "transformers", header, rows) | {"summary": summary}


if __name__ == "__main__":
    main()
