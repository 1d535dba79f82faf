"""Greedy generation with a static cache on attn_implementation="sdpa" and "fusedlayers".

    python examples/benchmark_transformers_generate.py             # GPU: see the defaults below
    python examples/benchmark_transformers_generate.py --batch-sizes 1,16 --new-tokens 256
    python examples/benchmark_transformers_generate.py --tiny      # CPU smoke run (fp32)

What a transformers user runs: `model.generate(..., cache_implementation="static")`. On CUDA,
generate then compiles the decode step itself (torch.compile, mode "reduce-overhead", so the
step replays as a CUDA graph) and runs the prefill eagerly. The model is a `LlamaForCausalLM`
from `benchmark_transformers.build_model` (random weights, nothing downloaded): Llama 3.2 1B's
width (hidden 2048, 32 query heads over 8 KV heads, head dim 64) with `--layers` layers, bf16.

Per batch size, both implementations run in this one process on the same random prompts. Each
runs one generate first (it compiles: reported as `first_s`), then `--repeats` timed ones.
Reported: the median seconds of a timed generate; new tokens per second (batch x new tokens
over that time, prefill included); the graphs Dynamo compiled (1: the decode step compiled
once, not once per step) and the graph breaks it counted (0 means the whole decode step is one
graph); and the share of generated tokens equal to sdpa's.
Greedy tokens of two bf16 kernels can part at a near tie and then differ for the rest of the
row, so that share is a sanity check, not a pass rule (the GPU tests check the tokens).

Without CUDA the script runs on the CPU, where generate does not compile and "fusedlayers"
takes its PyTorch reference path: a pipeline check (`--tiny`), not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from benchmark_transformers import DTYPES, build_model, sync

from fusedlayers.bench.record import run_header, write_run

FULL = dict(
    layers=4, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
    vocab=128256, rope_theta=500000.0, prompt=512, new_tokens=256, repeats=3,
)  # fmt: skip
TINY = dict(
    layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128,
    vocab=256, prompt=12, new_tokens=6, repeats=1, dtype="fp32", batch_sizes="1,2",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small model and prompts (CPU smoke run)")
    for name, value in FULL.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--json", type=Path, default=None, help="also write the run here")
    args = p.parse_args(argv)
    if args.tiny:  # the preset replaces the defaults only: explicit flags still win
        p.set_defaults(**TINY)
        args = p.parse_args(argv)
    args.seq_len = args.prompt + args.new_tokens  # what build_model sizes positions by
    return args


def generate_run(model, name: str, prompts: torch.Tensor, args, device: str) -> dict:
    """Switch to attention `name`, generate once (compiling), then time `repeats` generates."""
    from torch._dynamo.utils import counters

    model.set_attn_implementation(name)
    if hasattr(model, "_compiled_call"):  # generate keeps its compiled step on the model
        del model._compiled_call
    torch._dynamo.reset()
    counters.clear()
    kw = dict(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
        cache_implementation="static", use_cache=True, return_dict_in_generate=True,
    )  # fmt: skip
    seconds = []
    with torch.no_grad():
        for _ in range(1 + args.repeats):
            sync(device)
            start = time.perf_counter()
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)
            sync(device)
            seconds.append(time.perf_counter() - start)
    cache = type(out.past_key_values).__name__
    graphs = counters["stats"]["unique_graphs"]
    if cache != "StaticCache" or (device == "cuda" and not graphs):
        # A run that fell back to a dynamic cache or to eager steps measures something else.
        raise RuntimeError(f"{name}: generate used a {cache} and compiled {graphs} graphs")
    median = statistics.median(seconds[1:])
    b = prompts.shape[0]
    return {
        "attn_implementation": name,
        "batch_size": b,
        "first_s": seconds[0],
        "seconds_median": median,
        "seconds": seconds[1:],
        "new_tokens_per_s": b * args.new_tokens / median,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": graphs,
        "cache": cache,
        "tokens": out.sequences[:, prompts.shape[1] :].cpu(),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import transformers

    from fusedlayers.integrations.transformers import register

    register()  # attn_implementation="fusedlayers"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args, device).eval()
    model.config.use_cache = True  # build_model's config is for training
    model.generation_config.eos_token_id = None  # every row generates all its tokens
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(args.seed)
    params = sum(p.numel() for p in model.parameters())
    config = {k: v for k, v in vars(args).items() if k != "json"} | {"parameters": params}
    header = run_header(config=config, transformers=transformers.__version__, device=device)
    results = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prompts = torch.randint(1, args.vocab, (b, args.prompt), generator=gen).to(device)
        sdpa, fused = pair = [
            generate_run(model, name, prompts, args, device) for name in ("sdpa", "fusedlayers")
        ]
        same = (fused["tokens"] == sdpa["tokens"]).float().mean().item()
        for r in pair:
            r["speedup_vs_sdpa"] = r["new_tokens_per_s"] / sdpa["new_tokens_per_s"]
            r["same_tokens_as_sdpa"] = same
            del r["tokens"]
        results += pair
        if args.json is not None:  # after each batch size: a cut run keeps what it measured
            write_run(args.json, "transformers_generate", header, results)

    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (not a measurement)"
    print(
        f"{where}, Llama {params / 1e6:.1f}M params ({args.layers} layers), {args.dtype}, "
        f"prompt {args.prompt}, {args.new_tokens} new tokens, static cache, "
        f"1 + {args.repeats} generates per run"
    )
    print(
        "| batch | run | first s | s median | new tokens/s | vs sdpa | graphs | breaks "
        "| same tokens |"
    )
    print("|---" * 9 + "|")
    for r in results:
        print(
            f"| {r['batch_size']} | {r['attn_implementation']} | {r['first_s']:.1f} | "
            f"{r['seconds_median']:.3f} | {r['new_tokens_per_s']:,.0f} | "
            f"{r['speedup_vs_sdpa']:.3f}x | {r['graphs']} | {r['graph_breaks']} | "
            f"{r['same_tokens_as_sdpa']:.0%} |"
        )
    return {"kind": "transformers_generate", "header": header, "rows": results}


if __name__ == "__main__":
    main()
