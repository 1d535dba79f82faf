"""Run the forward kernel with explicit configs, each in a fresh process, to isolate device faults.

An illegal memory access poisons the CUDA context, so every (case, config) runs in its own
subprocess; the table says OK (with the max error against the fp32 reference over all repeats),
IMA (illegal memory access) or WRONG. `--sanitize` reruns one variant under compute-sanitizer.

    python examples/perf/debug_forward_configs.py [--jobs 12] [--repeat 20]
    python examples/perf/debug_forward_configs.py --sanitize d40dv24 64,64,4,3,64,32
"""

from __future__ import annotations

import argparse
import concurrent.futures
import subprocess
import sys

# name: (dtype, b, h, h_kv, s_q, s_k, d, d_v)
CASES = {
    "d40dv24": ("float16", 2, 2, 2, 33, 17, 40, 24),
    "d40dv24_long": ("float16", 2, 2, 2, 300, 200, 40, 24),
    "d40dv24_bf16": ("bfloat16", 2, 2, 2, 33, 17, 40, 24),
    "d24dv40": ("float16", 2, 2, 2, 33, 17, 24, 40),
    "d32dv32": ("float16", 2, 2, 2, 33, 17, 32, 32),
    "d64dv32": ("float16", 2, 2, 2, 33, 17, 64, 32),
}
CONFIGS = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 2), (64, 64, 8, 3)]


def _next_pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def variants() -> list[tuple[str, str]]:
    """(case, 'BM,BN,W,S,BLOCK_D,BLOCK_DV') per config: natural tile widths, and at least 64."""
    out = []
    for name, case in CASES.items():
        natural = (_next_pow2(case[-2]), _next_pow2(case[-1]))
        for cfg in CONFIGS:
            for widths in sorted({natural, tuple(max(w, 64) for w in natural)}):
                out.append((name, ",".join(map(str, (*cfg, *widths)))))
    return out


def worker(name: str, spec: str, repeat: int) -> None:
    """Runs one variant `repeat` times on fresh inputs; prints OK and the max error, or raises."""
    import torch
    from fusedlayers.kernels._flash_fwd import _attn_fwd, forward_launch

    from fusedlayers.attention.reference import attention_reference

    dtype, b, h, h_kv, s_q, s_k, d, d_v = CASES[name]
    bm, bn, warps, stages, block_d, block_dv = map(int, spec.split(","))
    none = dict.fromkeys(
        ("cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q", "seq_offsets_k", "max_seqlen_q")
        + ("max_seqlen_k", "seqlens_q", "seqlens_k", "bias", "alibi_slopes")
    )
    worst = 0.0
    for i in range(repeat):
        g = torch.Generator(device="cuda").manual_seed(i)
        shapes = ((b, s_q, h, d), (b, s_k, h_kv, d), (b, s_k, h_kv, d_v))
        q, k, v = (
            torch.randn(s, generator=g, device="cuda").to(getattr(torch, dtype)) for s in shapes
        )
        out, lse, grid, args, consts = forward_launch(
            q, k, v, **none, softmax_scale=d**-0.5, window_left=-1, window_right=-1,
            bottom_right=True, softcap=0.0, dropout_p=0.0, seed=0, offset=0,
        )  # fmt: skip
        consts.update(BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=bm, BLOCK_N=bn)
        _attn_fwd.fn[grid](*args, **consts, num_warps=warps, num_stages=stages)
        torch.cuda.synchronize()
        ref = attention_reference(q.float(), k.float(), v.float(), softmax_scale=d**-0.5)
        worst = max(worst, (out.float() - ref).abs().max().item())
    print(f"OK {worst:.3g}")


def run_variant(name: str, spec: str, repeat: int) -> tuple[str, str, str]:
    cmd = [sys.executable, __file__, "--worker", name, spec, "--repeat", str(repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if proc.returncode == 0:
        status = proc.stdout.strip().splitlines()[-1]
    elif "illegal memory access" in proc.stderr:
        status = "IMA"
    else:
        status = "ERROR " + proc.stderr.strip().splitlines()[-1][:90]
    worst = float(status.split()[1]) if status.startswith("OK") else 0.0
    if status.startswith("OK") and worst > 0.05:
        status = f"WRONG {worst:.3g}"
    return name, spec, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "SPEC"))
    parser.add_argument("--sanitize", nargs=2, metavar=("CASE", "SPEC"))
    opts = parser.parse_args()
    if opts.worker:
        worker(*opts.worker, opts.repeat)
        return
    if opts.sanitize:
        cmd = ["compute-sanitizer", "--tool", "memcheck", sys.executable, __file__, "--worker"]
        args = [*cmd, *opts.sanitize, "--repeat", "1"]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=200)
        print("\n".join((proc.stdout + proc.stderr).splitlines()[:40]))
        return
    with concurrent.futures.ThreadPoolExecutor(opts.jobs) as pool:
        jobs = [pool.submit(run_variant, n, s, opts.repeat) for n, s in variants()]
        for job in jobs:
            name, spec, status = job.result()
            print(f"{name:<14} BM,BN,W,S,BLOCK_D,BLOCK_DV={spec:<20} {status}", flush=True)


if __name__ == "__main__":
    main()
