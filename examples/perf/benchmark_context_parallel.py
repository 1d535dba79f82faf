"""Context-parallel attention throughput: CP=2 over two GPUs against one GPU, same work per GPU.

    torchrun --standalone --nproc_per_node 2 examples/perf/benchmark_context_parallel.py
    torchrun --standalone --nproc_per_node 2 examples/perf/benchmark_context_parallel.py \\
        --seqlen 65536 --batch 2 --heads 32 --kv-heads 8
    torchrun --standalone --nproc_per_node 2 examples/perf/benchmark_context_parallel.py --dry-run
    torchrun --standalone --nproc_per_node 2 examples/perf/benchmark_context_parallel.py \\
        --json bench/context_parallel.json                 # the run BENCHMARKS.md shows

Providers, bf16 causal `DotProductAttention` (bshd, d = 128) on the Triton kernels:
    cp2      the sequence of `--seqlen` tokens split over both ranks (TE's load-balanced chunks),
             batch `--batch`, the ring exchanging K/V (and dK/dV) over NCCL
    single   one GPU, the same length, batch `--batch / 2`: the same attention work per GPU
Work is counted as design.md does: `4*b*h*s*s*d / 2` (causal) for the forward, 3.5x that for
forward+backward; each provider's TFLOP/s is per GPU. `cp2 / single` is the ring's efficiency:
1.0 means the K/V exchange hides entirely behind the compute.

`--dry-run` runs tiny shapes on the CPU (gloo, reference path) to check the script itself.
Prints a markdown table on rank 0 and, with --json, writes the run there
(fusedlayers.bench.record, kind context_parallel: one row per pass).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from fusedlayers import DotProductAttention
from fusedlayers.attention.context_parallel import context_parallel_indices
from fusedlayers.bench.record import run_header, write_run


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=32768, help="full sequence length")
    p.add_argument("--batch", type=int, default=2, help="CP batch (single GPU runs half)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--fresh-inputs", action="store_true", help="new leaf tensors every call")
    p.add_argument("--dry-run", action="store_true", help="tiny CPU run (gloo, reference)")
    p.add_argument("--json", help="also write the run here (rank 0)")
    args = p.parse_args()
    if args.dry_run:
        args.seqlen, args.batch, args.heads, args.kv_heads, args.head_dim = 32, 2, 4, 2, 16
        args.warmup, args.iters = 1, 1
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(step, device, args, group=None) -> float:
    """Median wall time of `step()` in ms; ranks of `group` start each iteration together."""
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        _sync(device)
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def attention_steps(attn, b, s, args, device, dtype, rows=None):
    """(forward step, forward+backward step) on random q/k/v of length s (this rank's `rows` of
    it under CP): the same leaf tensors every call, as a training loop's or a benchmark's, or
    with `--fresh-inputs` new leaves per call (a copy of the same values, outside the timing's
    attention work but inside its wall time, for both providers alike)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(heads):
        t = torch.randn(b, s, heads, args.head_dim, generator=gen, device=device, dtype=dtype)
        return (t if rows is None else t[:, rows]).requires_grad_()

    q, k, v = rand(args.heads), rand(args.kv_heads), rand(args.kv_heads)
    dout = torch.randn_like(q).flatten(-2)

    def inputs():
        if not args.fresh_inputs:
            return q, k, v
        return [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def forward():
        with torch.no_grad():
            attn(*inputs())

    def forward_backward():
        attn(*inputs()).backward(dout)

    return forward, forward_backward


def main() -> None:
    args = parse_args()
    cuda = not args.dry_run
    if cuda:
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        device, dtype = torch.device("cuda", rank), torch.bfloat16
    else:
        dist.init_process_group("gloo")
        device, dtype = torch.device("cpu"), torch.float32
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"run with torchrun --nproc_per_node 2 (got {world} processes)")
    flops_fwd = 4 * args.batch * args.heads * args.seqlen**2 * args.head_dim / 2
    flops = {"fwd": flops_fwd, "fwd+bwd": 3.5 * flops_fwd}
    options = dict(num_gqa_groups=args.kv_heads, qkv_format="bshd", attn_mask_type="causal")
    stream = torch.cuda.Stream() if cuda else None
    cp = DotProductAttention(
        args.heads, args.head_dim, cp_group=dist.group.WORLD, cp_stream=stream, **options
    )
    rows = context_parallel_indices([args.seqlen], world, rank, device)
    steps = attention_steps(cp, args.batch, args.seqlen, args, device, dtype, rows)
    cp_ms = [time_ms(step, device, args, dist.group.WORLD) for step in steps]
    single_ms = [float("nan")] * 2
    if rank == 0:  # the other GPU waits: one GPU, half the batch, the whole sequence
        single = DotProductAttention(args.heads, args.head_dim, **options)
        steps = attention_steps(single, args.batch // 2, args.seqlen, args, device, dtype)
        single_ms = [time_ms(step, device, args) for step in steps]
    dist.barrier()
    if rank == 0:
        what = "bf16 Triton kernels, NCCL" if cuda else "dry run: CPU, gloo, reference path"
        print(
            f"causal attention, s={args.seqlen}, b={args.batch} (single GPU: {args.batch // 2}), "
            f"h={args.heads}, hg={args.kv_heads}, d={args.head_dim}; {what}; "
            f"{'new' if args.fresh_inputs else 'the same'} input tensors every call\n"
        )
        print("| pass | cp2 ms | cp2 TFLOP/s per GPU | single ms | single TFLOP/s | cp2 / single |")
        print("|---|---|---|---|---|---|")
        rows = []
        for (name, work), t_cp, t_one in zip(flops.items(), cp_ms, single_ms):
            per_gpu = work / world  # both providers do this much per GPU
            tf_cp, tf_one = per_gpu / t_cp / 1e9, per_gpu / t_one / 1e9
            print(
                f"| {name} | {t_cp:.2f} | {tf_cp:.1f} | {t_one:.2f} | {tf_one:.1f} | "
                f"{tf_cp / tf_one:.2f} |"
            )
            rows.append(
                {"pass": name, "seqlen": args.seqlen, "batch": args.batch, "heads": args.heads,
                 "kv_heads": args.kv_heads, "head_dim": args.head_dim, "world": world,
                 "fresh_inputs": args.fresh_inputs, "cp_ms": t_cp, "cp_tflops_per_gpu": tf_cp,
                 "single_ms": t_one, "single_tflops": tf_one, "flops_per_gpu": per_gpu}
            )  # fmt: skip
        if args.json:
            config = {k: v for k, v in vars(args).items() if k != "json"} | {"world": world}
            write_run(args.json, "context_parallel", run_header(config=config), rows)
            print(f"wrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
