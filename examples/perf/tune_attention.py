"""Launch-shape sweeps for the attention kernels on a CUDA GPU: the numbers behind the tables.

    python examples/perf/tune_attention.py --fwd --bwd --atomic --gqa [--dims 128,64]
                                      [--seqlen 4096] [--jobs 12] [--out DIR]

bf16, b = 16384 / s, h = 2048 / d, causal and not. Every candidate is checked before it is timed
(a fast wrong answer is no result):
- `--fwd`: the forward kernel at each (BLOCK_M, BLOCK_N, warps, stages) in
  FWD_SWEEP, launched directly (no autotuner), output within 1e-2 of SDPA's flash backend.
- `--bwd`: the two-pass backward, one pass at a time (the dK/dV and dQ kernels' times add), each
  candidate in BWD_SWEEP with the other pass at its entry in the table the launch reads;
  gradients bitwise reproducible and within 5e-3 of SDPA's flash backend. The best per pass over
  causal and not is printed.
- `--atomic`: the atomic-dQ backward (one dK/dV launch that also adds dQ, `deterministic=False`)
  at each (BLOCK_M1, BLOCK_N1, warps, stages) in ATOMIC_SWEEP; dK/dV bitwise reproducible and
  all gradients within 5e-3 of SDPA.
- `--gqa`: forward+backward of GQA 32:8 and 32:1 against MHA at s = 4096, d = 128, with the dK/dV
  pass's group split on (the default) and off.

Compiling dominates a sweep, so every candidate is first compiled in a pool of `--jobs`
processes (Triton's on-disk cache keeps the binaries); the timing then runs in this process, one
kernel at a time. Median of `triton.testing.do_bench`; TFLOP/s count the forward as
4*b*h*s*s*d (halved when causal), the backward as 2.5x and forward+backward as 3.5x that.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
from pathlib import Path

import torch

TOKENS, HIDDEN = 16384, 2048
BF16 = torch.bfloat16
# The forward launcher's sequence and bias arguments for a dense batch with none of them.
NO_SEQUENCES = dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q", "seq_offsets_k",
                              "max_seqlen_q", "max_seqlen_k", "seqlens_q", "seqlens_k", "bias",
                              "alibi_slopes"))  # fmt: skip

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim. (Warp specialization was swept here too
# and dropped from the kernel: no faster, and some tiles failed to compile under Triton 3.6.)
FWD_SWEEP = {
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2),
          (128, 64, 8, 4), (64, 64, 4, 3)],
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 128, 4, 3), (128, 64, 4, 4),
         (128, 128, 8, 2), (64, 128, 4, 3)],
}  # fmt: skip
# Per pass: dK/dV (BLOCK_M1, BLOCK_N1, WARPS1, STAGES1) and dQ (BLOCK_M2, BLOCK_N2, WARPS2,
# STAGES2). FlexAttention's sm90 choice for 64 < d <= 128 is (64, 128, 8, 3) / (128, 64, 8, 3).
BWD_SWEEP = {
    128: dict(
        dkdv=[(32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 2),
              (64, 128, 8, 2)],
        dq=[(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2)],
    ),
    64: dict(
        dkdv=[(64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 4, 3),
              (64, 64, 4, 4)],
        dq=[(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)],
    ),
    # 160 and 192 run on this entry too (their tiles are 256 columns wide). Within 227 KiB of
    # shared memory at 256 columns: resident + stages * streamed rows <= 227 (`bwd_config`).
    256: dict(
        dkdv=[(32, 64, 8, 2), (64, 64, 8, 2), (32, 64, 8, 3), (16, 64, 4, 3), (32, 64, 4, 2),
              (64, 64, 8, 1), (32, 128, 8, 2)],
        dq=[(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 3), (64, 32, 4, 2),
            (128, 64, 8, 1), (32, 64, 4, 2)],
    ),
}  # fmt: skip
# The atomic-dQ launch (BLOCK_M1, BLOCK_N1, WARPS1, STAGES1): 64 query rows keep the added dS^T K
# product on wgmma (it needs 64 rows); the first entry is today's two-pass dK/dV tile.
ATOMIC_SWEEP = {
    128: [(32, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 128, 8, 2),
          (64, 128, 8, 3), (128, 64, 8, 2), (32, 128, 8, 3)],
    64: [(32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 2),
         (128, 128, 8, 2)],
}  # fmt: skip


def problem(d: int, s: int, h: int | None = None, h_kv: int | None = None, seed: int = 0):
    """Seeded bf16 q, dout [b, s, h, d] and k, v [b, s, h_kv, d] on CUDA."""
    b, h = TOKENS // s, h or HIDDEN // d
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, dout = (torch.randn(b, s, h, d, generator=g, device="cuda", dtype=BF16) for _ in "qo")
    k, v = (torch.randn(b, s, h_kv or h, d, generator=g, device="cuda", dtype=BF16) for _ in "kv")
    return q, k, v, dout


def mask_args(d: int, causal: bool) -> dict:
    return dict(softmax_scale=d**-0.5, window_left=-1, window_right=0 if causal else -1,
                bottom_right=True)  # fmt: skip


def tflops(b, h, s, d, causal, ms, factor) -> float:
    return 4 * b * h * s * s * d * (0.5 if causal else 1.0) * factor / (ms * 1e-3) / 1e12


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    err = ((a.float() - b.float()).norm() / b.float().norm()).item()
    return err if math.isfinite(err) else math.inf


def sdpa_reference(q, k, v, dout, causal: bool, grads: bool):
    """SDPA flash backend's output (and q/k/v gradients) in our [b, s, h, d] layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.transpose(1, 2).detach().requires_grad_(grads) for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    if not grads:
        return out.transpose(1, 2)
    return [t.transpose(1, 2) for t in torch.autograd.grad(out, leaves, dout.transpose(1, 2))]


# --------------------------------------------------------------------------------------------------
# One candidate: run it (the pool compiles by running once), or check and time it
# --------------------------------------------------------------------------------------------------


def forward_runner(q, k, v, causal: bool, cfg: tuple):
    """A callable launching the forward kernel with one explicit config; returns out."""
    from fusedlayers.kernels._flash_fwd import _attn_fwd, forward_launch

    bm, bn, warps, stages = cfg

    def run():
        out, _, grid, args, consts = forward_launch(
            q, k, v, **NO_SEQUENCES, **mask_args(q.shape[-1], causal), softcap=0.0,
            dropout_p=0.0, seed=0, offset=0,
        )  # fmt: skip
        consts.update(BLOCK_M=bm, BLOCK_N=bn)
        _attn_fwd.fn[grid](*args, **consts, num_warps=warps, num_stages=stages)
        return out

    return run


def backward_runner(q, k, v, dout, causal: bool, cfg: tuple, atomic: bool = False):
    """A callable running the two-pass backward with the 8-field `cfg` as its table entry, or
    (`atomic`) the atomic-dQ scheme with the 4-field `cfg` as its launch."""
    from fusedlayers.kernels import _flash_bwd
    from fusedlayers.kernels._flash_bwd import flash_attention_backward
    from fusedlayers.kernels._flash_fwd import flash_attention_forward

    d = q.shape[-1]
    mask = mask_args(d, causal)
    out, lse = flash_attention_forward(
        q, k, v, **NO_SEQUENCES, **mask, softcap=0.0, dropout_p=0.0, seed=0, offset=0
    )
    # The table this launch reads, and where the atomic scheme may run ("any": the interpreter
    # too, so the CPU tests reach it).
    table = _flash_bwd.BWD_ATOMIC_CONFIGS if atomic else _flash_bwd.bwd_table(q.shape[1], causal)
    devices = "any" if atomic else _flash_bwd.ATOMIC_DQ_DEVICES
    bucket = _flash_bwd._bucket(table, d)  # the entry serving d (160 and 192: 256's)

    def run():
        saved = _flash_bwd.ATOMIC_DQ_DEVICES, table[bucket]
        _flash_bwd.ATOMIC_DQ_DEVICES, table[bucket] = devices, cfg
        # The backward keeps a launch plan per call signature, and the table entry is not part
        # of its key: without clearing, every candidate after the first would run the first's
        # tiles (a sweep on an H200 timed 14 candidates alike to 0.5%).
        _flash_bwd._PLANS.clear()
        try:
            return flash_attention_backward(dout, q, k, v, out, lse, **mask,
                                            deterministic=not atomic)[:3]  # fmt: skip
        finally:
            _flash_bwd.ATOMIC_DQ_DEVICES, table[bucket] = saved
            _flash_bwd._PLANS.clear()  # no plan of a candidate's tiles outlives it

    return run


def make_runner(job: dict):
    q, k, v, dout = problem(job["d"], job["s"])
    if job["kind"] == "fwd":
        return forward_runner(q, k, v, job["causal"], tuple(job["cfg"])), (q, k, v, dout)
    atomic = job["kind"] == "atomic"
    run = backward_runner(q, k, v, dout, job["causal"], tuple(job["cfg"]), atomic)
    return run, (q, k, v, dout)


def compile_job(job: dict) -> str:
    """Pool worker: run the candidate once so Triton compiles and caches it."""
    try:
        make_runner(job)[0]()
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # a shape that does not compile or launch (shared memory)
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"


def measure_job(job: dict) -> dict:
    """Check the candidate against SDPA (and itself, for determinism), then time it."""
    from triton.testing import do_bench

    run, (q, k, v, dout) = make_runner(job)
    try:
        first, again = run(), run()
    except Exception as error:
        return dict(job, ms=math.inf, error=f"{type(error).__name__}: {str(error)[:160]}")
    if job["kind"] == "fwd":
        err = rel_err(first, sdpa_reference(q, k, v, dout, job["causal"], grads=False))
        same, ok = True, err < 1e-2
    else:
        refs = sdpa_reference(q, k, v, dout, job["causal"], grads=True)
        err = max(rel_err(a, r) for a, r in zip(first, refs))
        # The atomic path's dQ sums in a varying order; its dK/dV must still be reproducible.
        checked = slice(1, 3) if job["kind"] == "atomic" else slice(0, 3)
        same = all(torch.equal(a, b) for a, b in zip(first[checked], again[checked]))
        ok = same and err < 5e-3
    ms = do_bench(run, warmup=10, rep=50, return_mode="median")
    b, s, h, d = q.shape
    factor = 1.0 if job["kind"] == "fwd" else 2.5
    return dict(job, ms=ms if ok else math.inf, raw_ms=ms, err=err, deterministic=same,
                tflops=tflops(b, h, s, d, job["causal"], ms, factor))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Sweeps
# --------------------------------------------------------------------------------------------------


def sweep_jobs(
    dims: list[int], seqlen: int, fwd: bool, bwd: bool, atomic: bool = False
) -> list[dict]:
    from fusedlayers.kernels import _flash_bwd

    jobs = []
    for d in dims:
        for causal in (False, True):
            shape = dict(d=d, s=seqlen, causal=causal)
            if fwd:
                jobs += [dict(shape, kind="fwd", cfg=list(c)) for c in FWD_SWEEP[d]]
            if atomic:
                jobs += [
                    dict(shape, kind="atomic", half="dkdv", cfg=list(c)) for c in ATOMIC_SWEEP[d]
                ]
            if not bwd:
                continue
            table = _flash_bwd.bwd_table(seqlen, causal)
            base = table[_flash_bwd._bucket(table, d)]
            for half in ("dkdv", "dq"):
                for cand in BWD_SWEEP[_flash_bwd._bucket(BWD_SWEEP, d)][half]:
                    cfg = cand + base[4:] if half == "dkdv" else base[:4] + cand
                    jobs.append(dict(shape, kind="bwd", half=half, cfg=list(cfg)))
    return jobs


def precompile(jobs: list[dict], workers: int) -> dict[int, str]:
    """Compile every job's kernels in parallel processes; {job index: error} for failures."""
    ctx = multiprocessing.get_context("spawn")  # CUDA does not survive fork
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        errors = list(pool.map(compile_job, jobs))
    return {i: e for i, e in enumerate(errors) if e}


def candidate(row: dict) -> tuple:
    """The swept part of a row's config: all of it (forward, atomic) or its pass's four fields."""
    if row["kind"] in ("fwd", "atomic"):
        return tuple(row["cfg"])
    return tuple(row["cfg"][:4] if row["half"] == "dkdv" else row["cfg"][4:])


def best_per_pass(rows: list[dict]) -> dict:
    """{(kind, d, half): the candidate with the least total ms over causal and not}."""
    totals: dict[tuple, dict[tuple, float]] = {}
    for r in rows:
        per_key = totals.setdefault((r["kind"], r["d"], r.get("half", "fwd")), {})
        per_key[candidate(r)] = per_key.get(candidate(r), 0.0) + r["ms"]
    return {key: min(c, key=c.get) for key, c in totals.items()}


def gqa_rows() -> list[dict]:
    """Forward+backward of GQA/MQA against MHA at s = 4096, d = 128, group split on and off."""
    from fusedlayers.kernels import _flash_bwd, flash_attention
    from triton.testing import do_bench

    rows = []
    for h, h_kv in ((16, 16), (32, 8), (32, 1)):
        for causal in (False, True):
            q, k, v, dout = problem(128, 4096, h, h_kv)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            window = (-1, 0) if causal else (-1, -1)

            def step(leaves=leaves, window=window, dout=dout):
                out = flash_attention(*leaves, softmax_scale=128**-0.5, window_size=window,
                                      deterministic=True)[0]  # fmt: skip
                return torch.autograd.grad(out, leaves, dout)

            grads = {}
            for split in ("auto", "off"):
                _flash_bwd.GROUP_SPLITS_OVERRIDE = None if split == "auto" else 1
                try:
                    grads[split] = step()
                    ms = do_bench(step, warmup=10, rep=50, return_mode="median")
                finally:
                    _flash_bwd.GROUP_SPLITS_OVERRIDE = None
                err = max(rel_err(a, r) for a, r in zip(grads[split], grads["auto"]))
                b = q.shape[0]
                rows.append(dict(h=h, h_kv=h_kv, causal=causal, split=split, ms=ms, err=err,
                                 tflops=tflops(b, h, 4096, 128, causal, ms, 3.5)))  # fmt: skip
                print(f"gqa h={h} h_kv={h_kv} causal={int(causal)} split={split}: {ms:.3f} ms "
                      f"{rows[-1]['tflops']:.0f} TF/s, grads vs split=auto {err:.1e}",
                      flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fwd", action="store_true", help="sweep FWD_SWEEP")
    parser.add_argument("--bwd", action="store_true", help="sweep BWD_SWEEP, per pass")
    parser.add_argument("--atomic", action="store_true", help="sweep ATOMIC_SWEEP")
    parser.add_argument("--gqa", action="store_true", help="GQA/MQA vs MHA, group split on/off")
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--jobs", type=int, default=12, help="compile processes")
    parser.add_argument("--out", default=None, help="folder for tune.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    report: dict = {}
    dims = [int(d) for d in args.dims.split(",")]
    jobs = sweep_jobs(dims, args.seqlen, args.fwd, args.bwd, args.atomic)
    if jobs:
        failed = precompile(jobs, args.jobs)
        rows = []
        for i, job in enumerate(jobs):
            row = dict(job, ms=math.inf, error=failed[i]) if i in failed else measure_job(job)
            rows.append(row)
            print(f"{row['kind']} d={row['d']} causal={int(row['causal'])} {row.get('half', '')} "
                  f"{tuple(row['cfg'])}: {row.get('raw_ms', math.inf):.3f} ms "
                  f"({row.get('tflops', 0):.0f} TF/s) err {row.get('err', -1):.1e} "
                  f"det {row.get('deterministic')} {row.get('error', '')}", flush=True)  # fmt: skip
        best = best_per_pass(rows)
        for key, cfg in best.items():
            print(f"best {key}: {cfg}", flush=True)
        report |= dict(rows=rows, best={str(k): v for k, v in best.items()})
    if args.gqa:
        report["gqa"] = gqa_rows()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tune.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
