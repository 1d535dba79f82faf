"""Attention in loops whose shapes change every call, as training with dynamic padding or packed
documents runs it: fusedlayers against SDPA, call by call, host and compile time included.

Every call is timed alone (synchronized before and after), so what a user waits for shows: the
first calls' compiling and autotuning, and every later call that meets a new specialization.
Loops (bf16, 16 query and 4 KV heads, d = 128, causal; one length draw per call, the same
draws for every provider):
    dense    flash_attn_func, b = 4, s drawn from [--min-len, --max-len]; SDPA's flash backend
             gets the same [b, h, s, d] problem (enable_gqa)
    varlen   flash_attn_varlen_func on --tokens tokens of packed documents of new lengths;
             SDPA-flash gets the documents as a padded batch [n, h, longest, d] (causal, so each
             document's queries see only its own keys; the padded rows are extra work SDPA
             pays and fusedlayers does not)
    padding  DotProductAttention(attn_mask_type="padding_causal") on [b, s, h, d] with new
             padding every call, b = 4, s = --max-len; SDPA's memory-efficient backend (flash
             takes no mask) gets the equivalent boolean mask and K/V repeated to 16 heads
SDPA's backend is pinned: its default dispatch on Hopper prefers cuDNN, which builds a plan
for every new shape (about 0.1 s a call in these loops), so the baseline would be cuDNN's
planning, not what a user of flash-attention-style kernels compares with.
Per loop and provider: the total, the first call, the median of calls after the fifth, and the
stalls: calls after the fifth slower than 5x that median (each a compile or a tuning pass).

    python examples/benchmark_dynamic_shapes.py                 # the three loops, 150 calls each
    python examples/benchmark_dynamic_shapes.py --cold-cache    # as on a fresh machine
    python examples/benchmark_dynamic_shapes.py --json bench/dynamic_shapes.json

`--cold-cache` points Triton's cache at a new empty folder before Triton is imported, so every
kernel compiles as it would on a fresh machine (PyTorch's own kernels are precompiled). Run it in
a new process: a warm process hides exactly what this measures.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import tempfile
import time

if "--cold-cache" in sys.argv:  # before Triton is imported: it reads its cache dir from here
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.bench.record import run_header, write_run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loops", default="dense,varlen,padding", help="dense,varlen,padding")
    p.add_argument("--calls", type=int, default=150, help="calls per loop and provider")
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384, help="varlen: tokens per call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cold-cache", action="store_true", help="compile into an empty Triton cache")
    p.add_argument("--json", help="write the run here (fusedlayers.bench.record)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, 4 calls")
    args = p.parse_args(argv)
    args.head_dim, args.batch = (16, 1) if args.dry_run else (HEAD_DIM, BATCH)
    args.loops = [name.strip() for name in args.loops.split(",") if name.strip()]
    unknown = set(args.loops) - set(LOOPS)
    if unknown:
        p.error(f"--loops: unknown {sorted(unknown)}; expected some of {list(LOOPS)}")
    if args.dry_run:
        args.calls, args.min_len, args.max_len, args.tokens = 4, 3, 9, 24
    return args


HEADS, KV_HEADS, HEAD_DIM, BATCH = 16, 4, 128, 4


def _sdpa_backend(device: str, backend: SDPBackend) -> SDPBackend:
    """`backend` on CUDA; the math backend for the CPU dry run (the fused ones are CUDA's)."""
    return backend if device == "cuda" else SDPBackend.MATH


def _randn(*shape, device, dtype):
    return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)


def _document_lengths(rng: random.Random, tokens: int, low: int, high: int) -> list[int]:
    """Lengths in [low, high] (the last one shorter if need be) summing to `tokens`."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(low, high), tokens - sum(lengths)))
    return lengths


def dense_calls(args, draw, device, dtype):
    """(fusedlayers call, SDPA call) for one dense length draw."""
    s = draw.randint(args.min_len, args.max_len)
    b, d = args.batch, args.head_dim
    q, k, v = (_randn(b, s, h, d, device=device, dtype=dtype) for h in (HEADS, KV_HEADS, KV_HEADS))

    def ours():
        fl.flash_attn_func(q, k, v, causal=True).sum().backward()

    def sdpa():
        with sdpa_kernel(_sdpa_backend(device, SDPBackend.FLASH_ATTENTION)):
            out = F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True
            )
        out.sum().backward()

    return ours, sdpa


def varlen_calls(args, draw, device, dtype):
    """(fusedlayers call, SDPA call) for one draw of packed document lengths."""
    lengths = _document_lengths(draw, args.tokens, max(1, args.min_len // 4), args.max_len)
    d = args.head_dim
    q, k, v = (_randn(sum(lengths), h, d, device=device, dtype=dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device=device, dtype=torch.int32)
    longest = max(lengths)
    padded = [_randn(len(lengths), h, longest, d, device=device, dtype=dtype)
              for h in (HEADS, KV_HEADS, KV_HEADS)]  # fmt: skip

    def ours():
        fl.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True).sum().backward()

    def sdpa():
        with sdpa_kernel(_sdpa_backend(device, SDPBackend.FLASH_ATTENTION)):
            out = F.scaled_dot_product_attention(*padded, is_causal=True, enable_gqa=True)
        out.sum().backward()

    return ours, sdpa


def padding_calls(args, draw, device, dtype):
    """(fusedlayers call, SDPA call) for one draw of per-sequence valid lengths."""
    b, s, d = args.batch, args.max_len, args.head_dim
    lengths = [draw.randint(args.min_len, s) for _ in range(b)]
    q, k, v = (_randn(b, s, h, d, device=device, dtype=dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    pad = torch.arange(s, device=device)[None, :] >= torch.tensor(lengths, device=device)[:, None]
    te_mask = pad[:, None, None, :]  # TE's padding mask: True where a key is padding
    keep = ~pad[:, None, :, None] & ~pad[:, None, None, :]
    keep &= torch.ones(s, s, dtype=torch.bool, device=device).tril()
    keep |= torch.eye(s, dtype=torch.bool, device=device)  # no empty rows for SDPA's softmax
    attention = fl.DotProductAttention(HEADS, d, num_gqa_groups=KV_HEADS, qkv_format="bshd",
                                       attn_mask_type="padding_causal")  # fmt: skip

    def ours():
        attention(q, k, v, attention_mask=te_mask).sum().backward()

    def sdpa():
        # K/V heads repeated in the call, as transformers' sdpa path does (repeat_kv): the
        # memory-efficient backend's grouped-query support varies by torch release.
        group = HEADS // KV_HEADS
        k_rep, v_rep = (t.transpose(1, 2).repeat_interleave(group, dim=1) for t in (k, v))
        with sdpa_kernel(_sdpa_backend(device, SDPBackend.EFFICIENT_ATTENTION)):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k_rep, v_rep, attn_mask=keep)
        out.sum().backward()

    return ours, sdpa


LOOPS = {"dense": dense_calls, "varlen": varlen_calls, "padding": padding_calls}


def time_call(call, device) -> float:
    """Seconds from the call's start to its GPU work's end."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def summarize(loop: str, provider: str, seconds: list[float]) -> dict:
    """One row: total, first call, median after the fifth call, and the stalls after it."""
    later = seconds[5:] or seconds
    median = statistics.median(later)
    stalls = [i for i, t in enumerate(seconds) if i >= 5 and t > 5 * median]
    return dict(loop=loop, provider=provider, calls=len(seconds), total_s=sum(seconds),
                first_s=seconds[0], median_ms=median * 1e3, max_after_fifth_ms=max(later) * 1e3,
                stalls=len(stalls), stall_calls=stalls[:20])  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    rows = []
    print("| loop | provider | calls | total s | first s | median ms | stalls (call index) |")
    print("|---|---|---|---|---|---|---|")
    for loop in args.loops:
        # Interleaved per call, one draw for both: neither provider sees a warmer GPU or
        # different shapes; each provider's first call is its own cold start.
        times = {"fusedlayers": [], "sdpa": []}
        draws = random.Random(f"{args.seed}/{loop}")
        for _ in range(args.calls):
            ours, sdpa = LOOPS[loop](args, draws, device, dtype)
            times["fusedlayers"].append(time_call(ours, device))
            times["sdpa"].append(time_call(sdpa, device))
        for provider, seconds in times.items():
            row = summarize(loop, provider, seconds)
            rows.append(row)
            print(f"| {loop} | {provider} | {row['calls']} | {row['total_s']:.2f} | "
                  f"{row['first_s']:.2f} | {row['median_ms']:.2f} | {row['stalls']} "
                  f"{row['stall_calls']} |")  # fmt: skip
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        config |= {"heads": HEADS, "kv_heads": KV_HEADS}
        write_run(args.json, "dynamic_shapes", run_header(config=config), rows)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
