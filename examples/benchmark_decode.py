"""Decode attention benchmark: the split-KV kernel against SDPA and FlexAttention on one cache.

One new query per sequence (s_q = 1) over a full KV cache: GQA 32:8, d = 128, bf16, batch
1 / 8 / 64, cache 1k / 8k / 32k / 128k tokens (combinations whose K/V cache passes --max-gb are
skipped). Providers, all on the same K/V memory:
    ours        fusedlayers.kernels.decode_attention on the contiguous cache [b, s, h_k, d]
    ours-paged  the same kernel on the same memory seen as pages of --page-size rows, with a
                shuffled block_table (the paged path's cost: one table load per key block)
    sdpa*       F.scaled_dot_product_attention(enable_gqa=True) on [b, h, s, d] views of the
                cache (no copy): default dispatch, then each backend forced
    flex        torch.compile(flex_attention) (dynamic after the first shape), enable_gqa=True
Time: triton.testing.do_bench median (L2 flushed before each run). The kernel entry is timed, not
`flash_attn_with_kvcache`: its validation reads device values back once per call (a host sync),
which the others do not do. With --cuda-graph every provider's call is captured once in a CUDA
graph and its replay is timed: the GPU's time without the host's, as a server that captures its
decode step sees it (a provider that cannot be captured is a note). Bandwidth: K/V bytes read /
time, next to a device-to-device copy's (bytes read + written) / time measured in the same run,
and the timing floor: the time this harness reads for a one-element kernel, which no call beats.
`vs best` = the best other provider's time / ours (>= 1.0: ours is as fast or faster).

    python examples/benchmark_decode.py                     # the full grid, < 3 min on an H100
    python examples/benchmark_decode.py --batches 8 --cache-lens 8192 --json decode.json
    python examples/benchmark_decode.py --dtype fp16 --providers ours,ours-paged,sdpa
    python examples/benchmark_decode.py --cuda-graph        # replays of captured calls
    python examples/benchmark_decode.py --cuda-graph --json bench/decode.json   # for the report

Every provider is checked against SDPA's math on the first batch entry before it is timed; a
provider that raises or disagrees is reported in the notes, never timed silently.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_utils import bench_ms, configure_dynamo, ints_arg, short_error  # noqa: E402

from fusedlayers.bench.record import run_header, write_run  # noqa: E402

DEVICE = "cuda"  # the CPU test points this at "cpu" to run the pipeline under the interpreter
DTYPES = ("bf16", "fp16")
GB = 1e9
PROVIDERS = ("ours", "ours-paged", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex")
OURS = ("ours", "ours-paged")
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}


# --------------------------------------------------------------------------------------------------
# Pure helpers (CPU-testable)
# --------------------------------------------------------------------------------------------------


def kv_bytes(b: int, s: int, h_kv: int, d: int, elem: int) -> int:
    """Bytes of K and V one decode step reads: both caches' first s rows of every sequence."""
    return 2 * b * s * h_kv * d * elem


def plan(batches, cache_lens, h_kv: int, d: int, elem: int, max_gb: float):
    """(b, s) combinations to run and the skipped ones with the reason."""
    run, skipped = [], []
    for b in batches:
        for s in cache_lens:
            size = kv_bytes(b, s, h_kv, d, elem) / GB
            if size > max_gb:
                skipped.append((b, s, f"K/V cache {size:.1f} GB > --max-gb {max_gb:g}"))
            else:
                run.append((b, s))
    return run, skipped


def finish(row: dict) -> dict:
    """Bandwidth per provider and `vs_best` = best other provider's time / ours."""
    for result in row["providers"].values():
        if result.get("us"):
            result["gbps"] = row["bytes"] / (result["us"] * 1e-6) / GB
    others = [r["us"] for n, r in row["providers"].items() if n not in OURS and r.get("us")]
    ours = row["providers"].get("ours", {}).get("us")
    paged = row["providers"].get("ours-paged", {}).get("us")
    row["vs_best"] = min(others) / ours if others and ours else None
    row["paged_vs_contiguous"] = paged / ours if paged and ours else None
    return row


def _cell(result: dict | None) -> str:
    if not result:
        return "-"
    if "us" not in result:
        return "failed"
    return f"{result['us']:.1f} us / {result['gbps']:.0f}"


def markdown(
    rows: list[dict],
    copy_gbps: float | None,
    header: str,
    notes: list[str],
    floor_us: float | None = None,
) -> str:
    """The results table: per provider `time / GB/s`, then the ratios."""
    names = [p for p in PROVIDERS if any(p in r["providers"] for r in rows)]
    lines = [header, ""]
    if copy_gbps is not None:
        lines.append(f"Device copy bandwidth (read + write) in this run: {copy_gbps:.0f} GB/s")
        lines.append("")
    if floor_us is not None:
        lines.append(
            f"Timing floor (one 1-element kernel, timed as the providers are): {floor_us:.1f} us"
        )
        lines.append("")
    lines.append("| b | cache | K/V MB | " + " | ".join(names) + " | vs best | paged/contig |")
    lines.append("|---" * (len(names) + 5) + "|")
    for r in rows:
        cells = [_cell(r["providers"].get(n)) for n in names]
        vs = f"{r['vs_best']:.2f}x" if r.get("vs_best") else "-"
        pc = f"{r['paged_vs_contiguous']:.3f}" if r.get("paged_vs_contiguous") else "-"
        mb = r["bytes"] / 1e6
        lines.append(
            f"| {r['b']} | {r['s']} | {mb:.0f} | " + " | ".join(cells) + f" | {vs} | {pc} |"
        )
    lines.append("")
    lines.append("cells: median time / achieved K/V bandwidth in GB/s; vs best = best other / ours")
    lines.extend(f"- {n}" for n in notes)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# GPU measurement
# --------------------------------------------------------------------------------------------------


def copy_bandwidth(warmup: int, rep: int) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    import torch

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup, rep)
    return 2 * 2**30 / (ms * 1e-3) / GB


def timing_floor(cuda_graph: bool, warmup: int, rep: int) -> float:
    """us that this harness reads for one kernel that does almost nothing: the launch (or the
    graph replay) and the timing events. No decode call can read less, so a small cache's
    bandwidth is set by this floor, not by how the kernel streams K/V."""
    import torch

    x = torch.zeros(1, device="cuda")
    call = _graphed(lambda: x.add_(1)) if cuda_graph else (lambda: x.add_(1))
    return 1e3 * bench_ms(call, warmup, rep)


def _providers(q, k_cache, v_cache, seqlens, page_size: int, wanted) -> dict[str, Callable]:
    """name -> zero-argument call returning out [b, 1, h, d], on the same K/V memory."""
    import torch
    import torch.nn.functional as F
    from fusedlayers.kernels import decode_attention

    b, s, h_kv, d = k_cache.shape
    scale = d**-0.5
    calls: dict[str, Callable] = {}
    if "ours" in wanted:
        calls["ours"] = lambda: decode_attention(q, k_cache, v_cache, seqlens, softmax_scale=scale)[
            0
        ]
    if "ours-paged" in wanted:
        pages_k = k_cache.view(-1, page_size, h_kv, d)
        pages_v = v_cache.view(-1, page_size, h_kv, d)
        # Shuffled pages; the check runs on the identity table (same logical cache as "ours").
        calls["ours-paged-check"] = lambda: decode_attention(
            q, pages_k, pages_v, seqlens, softmax_scale=scale,
            block_table=torch.arange(pages_k.shape[0], device=q.device, dtype=torch.int32)
            .view(b, -1),
        )[0]  # fmt: skip
        table = torch.randperm(pages_k.shape[0], device=q.device).to(torch.int32).view(b, -1)
        calls["ours-paged"] = lambda: decode_attention(
            q, pages_k, pages_v, seqlens, softmax_scale=scale, block_table=table
        )[0]
    q_bhsd, k_bhsd, v_bhsd = (t.transpose(1, 2) for t in (q, k_cache, v_cache))

    def sdpa(backend=None):
        def call():
            if backend is None:
                out = F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, enable_gqa=True)
            else:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(getattr(SDPBackend, backend)):
                    out = F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, enable_gqa=True)
            return out.transpose(1, 2)

        return call

    if "sdpa" in wanted:
        calls["sdpa"] = sdpa()
    for name, backend in SDPA_BACKENDS.items():
        if name in wanted:
            calls[name] = sdpa(backend)
    if "flex" in wanted:

        def flex():
            return _compiled_flex()(q_bhsd, k_bhsd, v_bhsd, enable_gqa=True).transpose(1, 2)

        calls["flex"] = flex
    return calls


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        # Default dynamic: after the first shape, one compile with dynamic sizes serves the rest
        # (a compile per shape would take most of the time budget).
        _FLEX = torch.compile(flex_attention)
    return _FLEX


def _graphed(call: Callable) -> Callable:
    """`call` captured in a CUDA graph (after warm-up calls on a side stream): its replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def _reference(q, k_cache, v_cache):
    """fp32 attention of sequence 0 (s_q = 1, GQA by repeat): [1, 1, h, d]."""
    group = q.shape[2] // k_cache.shape[2]
    k = k_cache[:1].float().repeat_interleave(group, dim=2).transpose(1, 2)
    v = v_cache[:1].float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = q[:1].float().transpose(1, 2) @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return (scores.softmax(-1) @ v).transpose(1, 2)


def run_combo(b: int, s: int, args, notes: list[str]) -> dict:
    import torch

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    g = torch.Generator(device=DEVICE).manual_seed(args.seed)
    q = torch.randn(b, 1, args.heads, args.head_dim, device=DEVICE, dtype=dtype, generator=g)
    shape = (b, s, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=dtype, generator=g)
    v_cache = torch.randn(shape, device=DEVICE, dtype=dtype, generator=g)
    seqlens = torch.full((b,), s, dtype=torch.int32, device=DEVICE)
    row = dict(b=b, s=s, bytes=kv_bytes(b, s, args.kv_heads, args.head_dim, 2), providers={})
    ref = _reference(q, k_cache, v_cache)
    paged_ok = s % args.page_size == 0
    wanted = [p for p in args.providers if p != "ours-paged" or paged_ok]
    calls = _providers(q, k_cache, v_cache, seqlens, args.page_size, wanted)
    for name in wanted:
        check = calls.get(name + "-check", calls[name])
        try:
            err = (check()[:1].float() - ref).abs().max().item()
            if not err < 2e-2:
                raise AssertionError(f"max error {err:.3g} against fp32 attention")
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            timed = _graphed(calls[name]) if args.cuda_graph else calls[name]
            us = 1e3 * bench_ms(timed, args.warmup, args.rep)
            row["providers"][name] = dict(us=us, max_error=err)
        except Exception as error:  # a provider that cannot run is a note, not a crash
            row["providers"][name] = dict(error=short_error(error))
            notes.append(f"b={b} s={s} {name}: {short_error(error)}")
    del q, k_cache, v_cache, calls
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return finish(row)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=ints_arg, default=[1, 8, 64])
    p.add_argument("--cache-lens", type=ints_arg, default=[1024, 8192, 32768, 131072])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--max-gb", type=float, default=60.0, help="skip caches larger than this")
    p.add_argument(
        "--providers", type=lambda t: t.split(","), default=list(PROVIDERS),
        help=",".join(PROVIDERS),
    )  # fmt: skip
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time, ms")
    p.add_argument("--time-limit", type=float, default=150, help="s; no combo starts after it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graph", action="store_true", help="time replays of captured calls")
    p.add_argument("--json", help="also write the run here (fusedlayers.bench.record, kind decode)")
    args = p.parse_args(argv)
    unknown = set(args.providers) - set(PROVIDERS)
    if unknown:
        p.error(f"unknown providers {sorted(unknown)}; choose from {PROVIDERS}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    configure_dynamo()
    started = time.time()
    combos, skipped = plan(args.batches, args.cache_lens, args.kv_heads, args.head_dim, 2,
                           args.max_gb)  # fmt: skip
    notes = [f"skipped b={b} s={s}: {why}" for b, s, why in skipped]
    copy_gbps = copy_bandwidth(args.warmup, args.rep)
    floor_us = timing_floor(args.cuda_graph, args.warmup, args.rep)
    mode = "graph" if args.cuda_graph else "eager"
    rows = []
    for b, s in combos:
        if time.time() - started > args.time_limit:
            notes.append(f"skipped b={b} s={s}: --time-limit {args.time_limit:g} s reached")
            continue
        rows.append({"mode": mode, **run_combo(b, s, args, notes)})
        print(f"b={b} s={s} done at {time.time() - started:.0f} s", file=sys.stderr)
    header = (
        f"## Decode attention, {torch.cuda.get_device_name()}: s_q=1, GQA {args.heads}:"
        f"{args.kv_heads}, d={args.head_dim}, {args.dtype}, page {args.page_size} "
        f"(torch {torch.__version__}, triton {triton.__version__})"
        + (", each call captured in a CUDA graph and replayed" if args.cuda_graph else "")
    )
    print(markdown(rows, copy_gbps, header, notes, floor_us))
    if args.json:
        config = {
            "s_q": 1, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
            "dtype": args.dtype, "page_size": args.page_size, "mode": mode,
            "warmup_ms": args.warmup, "rep_ms": args.rep,
        }  # fmt: skip
        extra = dict(description=header, copy_gbps=copy_gbps, floor_us=floor_us, notes=notes)
        write_run(args.json, "decode", run_header(config=config, **extra), rows)
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
