"""How many splits a decode call should take: the split-KV kernel's time against `num_splits`.

`num_splits=0` asks `kernels._flash_decode.num_splits_heuristic`; this script times every listed
split count on the same cache (each call captured in a CUDA graph and its replay timed, as
`benchmark_decode.py --cuda-graph` does), next to the heuristic's pick and SDPA's cuDNN backend,
so the heuristic can be checked against measurements. Cells: s_q = 1, bf16, GQA --heads:--kv-heads,
d = --head-dim, batch x cache length. The timing floor (a captured one-element kernel) is printed
first: no call reads less.

--combine fused,separate (the default) times every cell once per way of merging the splits, one
row each, in this process: `fused` merges in the main launch (`_flash_decode.FUSED_COMBINE`, one
launch a call), `separate` in a second launch. One split needs no merge: its column reads the
same kernel in both rows.

    python examples/perf/decode_splits.py
    python examples/perf/decode_splits.py --heads 12 --kv-heads 12 --head-dim 64 --batches 1 \
        --cache-lens 1280                                    # GPT-125M's decode attention
    python examples/perf/decode_splits.py --batches 1 --cache-lens 8192 --splits 8,16,32 \
        --combine separate,fused                             # the merge A/B at b = 1, 8k
    python examples/perf/decode_splits.py --layouts contiguous,paged   # paged caches beside

--layouts contiguous,paged times each cell on a contiguous cache and on the same memory as a paged
one (pages of --page-size rows, the block table shuffled, as `benchmark_decode.py` builds it),
one row each, so the two can be compared split count by split count in one process;
--page-prefetch on,off times paged rows once per setting of `_flash_decode.PAGE_PREFETCH` (each
key block's page read a block ahead, or just before its K/V loads).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_utils import bench_ms, csv_arg, ints_arg  # noqa: E402
from benchmark_decode import _graphed, kv_bytes, timing_floor  # noqa: E402

COMBINES = ("fused", "separate")
LAYOUTS = ("contiguous", "paged")
SWITCH = ("on", "off")


def time_cell(
    b: int, s: int, args, combine: str = "fused", layout: str = "contiguous", prefetch: str = "on"
) -> str:
    """One table row: the heuristic's pick and time, each split count's time, cuDNN's time,
    with the splits merged as `combine` says, on a `layout` cache (paged: pages read a block
    ahead when `prefetch` is "on")."""
    import torch.nn.functional as F
    from fusedlayers.kernels import _flash_decode, decode_attention
    from fusedlayers.kernels._common import cdiv, next_pow2
    from fusedlayers.kernels._flash_decode import MAX_BLOCK_M, num_splits_heuristic
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d, h, h_kv = args.head_dim, args.heads, args.kv_heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(b, s, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    rows = h // h_kv  # s_q = 1: one row per query head of a KV head
    tiles = b * h_kv * cdiv(rows, max(16, min(next_pow2(rows), MAX_BLOCK_M)))  # as `_make_plan`
    paged = layout == "paged"
    pick = num_splits_heuristic(tiles, s, q.device)
    cache = {}
    if paged:
        # The same memory as pages; shuffled, so neighbouring key blocks sit apart.
        k, v = (t.view(-1, args.page_size, h_kv, d) for t in (k, v))
        table = torch.randperm(k.shape[0], device="cuda", generator=gen).to(torch.int32)
        cache["block_table"] = table.view(b, -1)
    # Read by every eager call and capture below; the warm-ups in `_graphed` make the fused
    # merge's counters before any capture.
    _flash_decode.FUSED_COMBINE = combine == "fused"
    _flash_decode.PAGE_PREFETCH = prefetch == "on"
    ref, cells = None, []
    for n in [*args.splits, 0]:  # 0: the heuristic, timed last

        def call(n=n):
            return decode_attention(q, k, v, seqlens, softmax_scale=d**-0.5, num_splits=n, **cache)

        out = call()[0]
        ref = out if ref is None else ref
        err = (out.float() - ref.float()).abs().max().item()
        if not err < 2e-2:
            raise AssertionError(
                f"b={b} s={s} num_splits={n}: {err} from num_splits={args.splits[0]}"
            )
        cells.append(1e3 * bench_ms(_graphed(call), args.warmup, args.rep))
    k, v = (t.view(b, s, h_kv, d) for t in (k, v))  # cuDNN reads the pages' memory in order
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q_t, k_t, v_t, enable_gqa=True)

    cudnn_us = 1e3 * bench_ms(_graphed(cudnn), args.warmup, args.rep)
    heuristic_us = cells.pop()
    best = min(range(len(cells)), key=cells.__getitem__)
    text = [f"**{t:.1f}**" if i == best else f"{t:.1f}" for i, t in enumerate(cells)]
    gbps = kv_bytes(b, s, h_kv, d, 2) / (cells[best] * 1e-6) / 1e9
    if paged:
        layout += f", prefetch {prefetch}"
    row = f"| {b} | {s} | {layout} | {combine} | {pick}, {heuristic_us:.1f} | " + " | ".join(text)
    return row + f" | {cudnn_us:.1f} | {gbps:.0f} |"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=ints_arg, default=[1, 8])
    p.add_argument("--cache-lens", type=ints_arg, default=[1024, 8192, 32768, 131072])
    p.add_argument("--splits", type=ints_arg, default=[1, 4, 8, 16, 24, 32, 48, 64])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time, ms")
    p.add_argument(
        "--combine", type=csv_arg(COMBINES), default=list(COMBINES),
        help="how split calls merge, one row each: " + ",".join(COMBINES),
    )  # fmt: skip
    p.add_argument(
        "--layouts", type=csv_arg(LAYOUTS), default=["contiguous"],
        help="the cache layouts to time, one row each: " + ",".join(LAYOUTS),
    )  # fmt: skip
    p.add_argument("--page-size", type=int, default=256, help="rows per page of a paged cache")
    p.add_argument(
        "--page-prefetch", type=csv_arg(SWITCH), default=["on"],
        help="paged rows once per setting of _flash_decode.PAGE_PREFETCH: " + ",".join(SWITCH),
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from fusedlayers.kernels import _flash_decode

    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"timing floor: {timing_floor(True, args.warmup, args.rep):.1f} us")
    columns = " | ".join(str(n) for n in args.splits)
    print(
        f"| b | cache | layout | merge | heuristic: splits, us | {columns} | cuDNN us | best GB/s |"
    )
    print("|---" * (len(args.splits) + 7) + "|")
    defaults = _flash_decode.FUSED_COMBINE, _flash_decode.PAGE_PREFETCH
    try:
        for b in args.batches:
            for s in args.cache_lens:
                for layout in args.layouts:
                    for prefetch in args.page_prefetch if layout == "paged" else ["on"]:
                        for combine in args.combine:
                            row = time_cell(b, s, args, combine, layout, prefetch)
                            print(row, flush=True)
                torch.cuda.empty_cache()
    finally:
        _flash_decode.FUSED_COMBINE, _flash_decode.PAGE_PREFETCH = defaults
    print(
        "cells: us per call (graph replay, median); bold: the fastest split count of the row; "
        "merge: fused = in the main launch, separate = a second launch"
    )


if __name__ == "__main__":
    main()
