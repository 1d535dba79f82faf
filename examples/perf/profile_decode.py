"""Where a GPT decode step spends its time: the host frames of an eager step, and the GPU
kernels of a graph-captured step beside the plain compiled model's.

    python examples/perf/profile_decode.py [--config gpt-125m] [--batch 1] [--prompt 1024]

Same setup as examples/benchmark_generate.py (bf16, the same weights in both models, a random
prompt, greedy tokens). Prints:
- eager: host ms per step, the device syncs one step makes (`torch.cuda.set_sync_debug_mode`),
  and the top Python frames of 20 steps by own time and by cumulative time (cProfile);
- graph: GPU us per step by kernel over 20 replays of fusedlayers' `DecodeGraph` (torch.profiler),
  and the same for the plain model under `torch.compile(mode="reduce-overhead")`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark_generate import build  # noqa: E402
from fusedlayers.models import GPTConfig  # noqa: E402

from fusedlayers.layers.decode_graph import DecodeGraph  # noqa: E402
from fusedlayers.layers.inference import InferenceParams  # noqa: E402

STEPS = 20


def kernel_table(step, steps: int = STEPS, rows: int = 25) -> str:
    """GPU time per step by kernel name over `steps` calls of `step()`."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / steps
    launches = sum(e.count for e in events) / steps
    lines = [f"GPU us per step: {total:.1f} in {launches:.0f} kernels"]
    lines.append("| us/step | calls/step | kernel |")
    lines.append("|---|---|---|")
    for e in events[:rows]:
        lines.append(f"| {e.device_time_total / steps:.1f} | {e.count / steps:g} | {e.key[:90]} |")
    return "\n".join(lines)


def host_profile(step, steps: int = STEPS) -> str:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{Path(w.filename).name}:{w.lineno}" for w in caught]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    head = [f"eager host ms per step: {ms:.2f}", f"device syncs in one step: {len(syncs)}"]
    head += [f"  at {s}" for s in sorted(set(syncs))[:10]]
    return "\n".join(head) + "\n" + out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt-125m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--skip-plain", action="store_true", help="no compiled plain model")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    c = GPTConfig.named(args.config)
    ours, plain = build(c, "cuda", torch.bfloat16)
    b, s = args.batch, args.prompt
    room = 8 * STEPS  # every profiled step advances the cache by one token
    prompt = torch.randint(0, c.vocab_size, (b, s), device="cuda")
    print(f"{torch.cuda.get_device_name()}, {args.config}, batch {b}, prompt {s}", flush=True)

    with torch.no_grad():
        params = InferenceParams(b, s + room)
        token = ours(prompt, inference_params=params)[:, -1:].argmax(-1)
        params.advance(s)

        def eager():
            out = ours(token, inference_params=params)[:, -1]
            params.advance(1)
            return out

        print("\n## ours-eager\n" + host_profile(eager), flush=True)
        params.set_sequence_lengths([s] * b)
        graph = DecodeGraph(lambda t: ours(t, inference_params=params)[:, -1], params, token)
        print("\n## ours-graph\n" + kernel_table(lambda: graph(token)), flush=True)

        if not args.skip_plain:
            plain.setup_cache(b, s + room)
            plain(prompt, torch.arange(s, device="cuda"))
            pos = torch.tensor([s], device="cuda")
            step = torch.compile(
                lambda t, p: plain(t, p), mode="reduce-overhead", fullgraph=True, dynamic=False
            )

            def compiled():
                torch.compiler.cudagraph_mark_step_begin()
                return step(token, pos)

            print("\n## plain-compiled\n" + kernel_table(compiled), flush=True)


if __name__ == "__main__":
    main()
