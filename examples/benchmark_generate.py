"""Generation throughput: the fusedlayers GPT, eager and with its decode step in a CUDA graph,
against the same model in plain PyTorch with SDPA and a static KV cache, eager and under
`torch.compile(mode="reduce-overhead")` (gpt-fast's approach: the compiled step runs as a CUDA
graph).

    python examples/benchmark_generate.py                      # gpt-125m, batch 1 and 16
    python examples/benchmark_generate.py --batches 1 --new-tokens 128 --json gen.json
    python examples/benchmark_generate.py --json bench/generate.json   # the run the report shows
    python examples/benchmark_generate.py --dry-run            # tiny model on the CPU

Every model starts from the same weights (the plain model gets the fused QKV regrouped, as in
examples/benchmark_gpt.py), runs in bf16 (fp32 in --dry-run), and decodes greedily from the same
random prompt of --prompt tokens. Per model and batch: prefill time, decode ms/token (one step:
one new token for every sequence), decode tokens/s (batch * steps / decode time), one-time setup
(graph capture or compilation) and how many greedy tokens agree with ours-eager's. Each variant
runs once untimed first (Triton compiles its kernels, Inductor compiles), then timed.

Providers:
    ours-eager   GPT.forward per step on an InferenceParams cache (split-KV decode kernel)
    ours-graph   the same step captured once with fusedlayers' DecodeGraph, replayed per token
    plain-eager  plain PyTorch: static cache [b, h_kv, s_max, d], index_copy_ writes, SDPA over
                 the whole cache with a boolean causal-mask row per query
    plain-compiled  that step under torch.compile(mode="reduce-overhead", fullgraph=True)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_gpt import PlainGPT, _rope, copy_from_fused  # noqa: E402
from fusedlayers.models import GPT, GPTConfig  # noqa: E402

from fusedlayers.bench.record import run_header, write_run  # noqa: E402
from fusedlayers.layers.decode_graph import DecodeGraph  # noqa: E402
from fusedlayers.layers.inference import InferenceParams  # noqa: E402

PROVIDERS = ("ours-eager", "ours-graph", "plain-eager", "plain-compiled")


class StaticKVCache(torch.nn.Module):
    """One layer's keys and values [b, h_kv, s_max, d], as non-persistent buffers."""

    def __init__(self, b: int, heads: int, s_max: int, d: int, dtype, device) -> None:
        super().__init__()
        shape = (b, heads, s_max, d)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)


class CachedPlainGPT(PlainGPT):
    """`PlainGPT` (same parameters, so `copy_from_fused` loads it) with gpt-fast's static cache:
    forward(idx [b, s], input_pos [s] int64) -> logits [b, s, V] fp32."""

    def setup_cache(self, b: int, s_max: int) -> None:
        """Empty caches for b sequences of s_max tokens; the same tensors when the shape is
        unchanged (a compiled step guards on them: new ones would recompile it)."""
        c, w = self.c, self.tok_emb.weight
        old = getattr(self.layers[0], "kv_cache", None)
        if old is not None and old.k.shape == (b, c.n_kv_head, s_max, c.head_dim):
            for layer in self.layers:
                layer.kv_cache.k.zero_()
                layer.kv_cache.v.zero_()
            return
        for layer in self.layers:
            layer.kv_cache = StaticKVCache(b, c.n_kv_head, s_max, c.head_dim, w.dtype, w.device)
        causal = torch.ones(s_max, s_max, dtype=torch.bool, device=w.device).tril()
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        c, (b, s) = self.c, idx.shape
        mask = self.causal[None, None, input_pos]  # [1, 1, s, s_max]: True = attend
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        x = self.tok_emb(idx)
        kv = c.n_kv_head * c.head_dim
        for layer in self.layers:
            q, k, v = layer.qkv(layer.norm1(x)).split([c.d_model, kv, kv], dim=-1)
            q = _rope(q.view(b, s, c.n_head, c.head_dim), cos, sin).transpose(1, 2)
            k = _rope(k.view(b, s, c.n_kv_head, c.head_dim), cos, sin).transpose(1, 2)
            v = v.view(b, s, c.n_kv_head, c.head_dim).transpose(1, 2)
            layer.kv_cache.k.index_copy_(2, input_pos, k)
            layer.kv_cache.v.index_copy_(2, input_pos, v)
            a = F.scaled_dot_product_attention(
                q, layer.kv_cache.k, layer.kv_cache.v, attn_mask=mask,
                enable_gqa=c.n_kv_head != c.n_head,
            )  # fmt: skip
            x = x + layer.proj(a.transpose(1, 2).reshape(b, s, c.d_model))
            gate, up = layer.fc1(layer.norm2(x)).chunk(2, dim=-1)
            x = x + layer.fc2(F.silu(gate) * up)
        return F.linear(self.final_norm(x), self.tok_emb.weight).float()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1, keepdim=True)  # [b, 1]


def generate_ours(
    model: GPT, prompt: torch.Tensor, new: int, graph: bool, cache_class=InferenceParams
) -> dict:
    """Prefill, then `new - 1` decode steps on the fusedlayers GPT; times each phase.
    `cache_class`: the `InferenceParams` of the package `model` comes from (another revision's,
    for `examples/perf/gpt_ab.py`)."""
    b, s = prompt.shape
    device = prompt.device.type
    params = cache_class(b, s + new)
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        tok = _greedy(model(prompt, inference_params=params)[:, -1])
        params.advance(s)
        _sync(device)
        t1 = time.perf_counter()

        def eager(t: torch.Tensor) -> torch.Tensor:
            out = model(t, inference_params=params)[:, -1]
            params.advance(1)
            return out

        step = eager
        if graph:
            step = DecodeGraph(lambda t: model(t, inference_params=params)[:, -1], params, tok)
        _sync(device)
        t2 = time.perf_counter()
        tokens = [tok]
        for _ in range(new - 1):
            tokens.append(_greedy(step(tokens[-1])))
        _sync(device)
        t3 = time.perf_counter()
    return _timing(torch.cat(tokens, 1), t1 - t0, t2 - t1, t3 - t2, new - 1)


def generate_plain(model: CachedPlainGPT, prompt: torch.Tensor, new: int, step_fn) -> dict:
    """The same on the plain model: eager prefill, then `step_fn(token, input_pos)` steps."""
    b, s = prompt.shape
    device = prompt.device.type
    model.setup_cache(b, s + new)
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        tok = _greedy(model(prompt, torch.arange(s, device=prompt.device))[:, -1])
        _sync(device)
        t1 = time.perf_counter()
        pos = torch.tensor([s], device=prompt.device)
        tokens = [tok]
        for _ in range(new - 1):
            if device == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            tokens.append(_greedy(step_fn(tokens[-1], pos)[:, -1]))
            pos += 1
        _sync(device)
        t2 = time.perf_counter()
    return _timing(torch.cat(tokens, 1), t1 - t0, 0.0, t2 - t1, new - 1)


def _timing(tokens, prefill_s, setup_s, decode_s, steps) -> dict:
    b = tokens.shape[0]
    return {
        "tokens": tokens,
        "prefill_ms": prefill_s * 1e3,
        "setup_ms": setup_s * 1e3,
        "ms_per_token": decode_s * 1e3 / max(steps, 1),
        "tokens_per_s": b * steps / decode_s if decode_s > 0 else float("nan"),
    }


def build(c: GPTConfig, device: str, dtype: torch.dtype) -> tuple[GPT, CachedPlainGPT]:
    torch.manual_seed(0)
    ours = GPT(c, device=device).eval()
    plain = CachedPlainGPT(c).to(device).eval()
    copy_from_fused(plain, ours)
    return ours.to(dtype), plain.to(dtype)


def run_provider(name: str, ours, plain, prompt, new: int, compiled: dict) -> dict:
    if name.startswith("ours"):
        return generate_ours(ours, prompt, new, graph=name == "ours-graph")
    if name == "plain-eager":
        return generate_plain(plain, prompt, new, plain)
    key = prompt.shape[0]
    if key not in compiled:  # one compilation per batch size, static shapes (gpt-fast's setup)
        torch._dynamo.reset()
        fn = lambda t, pos: plain(t, pos)  # noqa: E731
        compiled[key] = torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return generate_plain(plain, prompt, new, compiled[key])


def bench_batch(args, c, ours, plain, b: int) -> dict:
    device = "cpu" if args.dry_run else "cuda"
    g = torch.Generator().manual_seed(b)
    prompt = torch.randint(0, c.vocab_size, (b, args.prompt), generator=g).to(device)
    results, compiled = {}, {}
    for name in args.providers:
        if name in ("ours-graph", "plain-compiled") and device != "cuda":
            results[name] = {"skipped": "needs CUDA"}
            continue
        t0 = time.perf_counter()
        try:
            # Warm-up with as many tokens as the timed run, for every provider: the compiled
            # step is specialized to the cache's shape (prompt + new tokens), and the eager
            # kernels meet new length specializations as the cache grows. A shorter warm-up
            # left that compilation inside the timed decode (77 ms per token compiled; eager
            # on a cold Triton cache 25-31 ms per token at batch 1 against 13-17 warm, H100).
            run_provider(name, ours, plain, prompt, args.new_tokens, compiled)
            warm_s = time.perf_counter() - t0
            r = run_provider(name, ours, plain, prompt, args.new_tokens, compiled)
        except Exception as error:  # a provider that fails is reported, the others still run
            if args.dry_run:
                raise
            results[name] = {"skipped": f"{type(error).__name__}: {str(error)[:200]}"}
            continue
        r["warmup_s"] = warm_s
        results[name] = r
    base = results.get("ours-eager", {}).get("tokens")
    for r in results.values():
        tokens = r.pop("tokens", None)
        if tokens is not None and base is not None:
            r["agree_with_ours_eager"] = (tokens == base).float().mean().item()
            r["identical_to_ours_eager"] = bool(torch.equal(tokens, base))
    return results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt-125m")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--providers", type=lambda s: s.split(","), default=list(PROVIDERS))
    p.add_argument(
        "--json", type=Path, default=None, help="also write the run here (kind generate)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny model, short prompt, fp32 on the CPU: checks the pipeline, times nothing real",
    )
    args = p.parse_args(argv)
    unknown = sorted(set(args.providers) - set(PROVIDERS))
    if unknown:
        p.error(f"unknown providers {unknown}; choose from {', '.join(PROVIDERS)}")
    if args.dry_run:
        args.config, args.batches, args.prompt, args.new_tokens = "tiny", [1, 2], 12, 6
    return args


def main(argv=None) -> dict:
    """Run every batch and provider; returns the run as `write_run` writes it (kind generate,
    one row per batch and provider)."""
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    c = GPTConfig.named(args.config)
    if args.prompt + args.new_tokens > c.context_length:
        raise SystemExit(f"prompt + new tokens exceed {args.config}'s context {c.context_length}")
    ours, plain = build(c, device, dtype)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    config = {"config": args.config, "prompt": args.prompt, "new_tokens": args.new_tokens}
    header = run_header(config=config | {"dtype": str(dtype), "batches": args.batches})
    run = {"kind": "generate", "header": header, "rows": []}
    print(f"{gpu}, {args.config}, {dtype}, prompt {args.prompt}, {args.new_tokens} new tokens")
    print("setup s: warm-up run (compilation) + graph capture", flush=True)
    print("| batch | provider | prefill ms | decode ms/token | tokens/s | setup s | agree |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batches:
        rows = bench_batch(args, c, ours, plain, b)
        run["rows"] += [
            {"batch": b, "provider": n, "config": args.config, **r} for n, r in rows.items()
        ]
        for name, r in rows.items():
            if "skipped" in r:
                print(f"| {b} | {name} | skipped: {r['skipped']} | | | | |")
                continue
            print(
                f"| {b} | {name} | {r['prefill_ms']:.1f} | {r['ms_per_token']:.3f} | "
                f"{r['tokens_per_s']:,.0f} | {r['warmup_s'] + r['setup_ms'] / 1e3:.1f} | "
                f"{r.get('agree_with_ours_eager', float('nan')):.3f} |",
                flush=True,
            )
        if args.json:  # after every batch, so a run cut short keeps what it measured
            write_run(args.json, "generate", header, run["rows"])
    return run


if __name__ == "__main__":
    main()
