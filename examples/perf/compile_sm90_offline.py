"""Compile the sm_90 Gluon kernels for an H100 on a machine without a GPU, and read the
compiler's resource report (registers, spills, shared memory).

    python examples/perf/compile_sm90_offline.py [--kernels fwd,bwd] [--dims 128,64]
        [--causal 0,1] [--fwd-persistent 0,1] [--fwd-layouts dense,varlen] [--partitions]
        [--bwd-variants default,none,split_ring,dv_early,split_ring+dv_early] [--dump DIR]

Run it with the Triton whose build you want to read (3.6 and 3.9 both compile these kernels):
Gluon's API and the compiler's choices differ between versions. A stand-in driver reports an
sm_90 target, and the launchers run on CPU tensors with every kernel launch turned into a
compile-only warm-up, so the compiled kernel is exactly what that launch would build (same
specializations: strides divisible by 16, constexprs). ptxas (bundled with Triton) then reports
per kernel: registers, spill stores/loads and the stack frame. ptxas reports the kernel as a
whole; `--partitions` also splits its SASS where the warp-specialized partitions set their
register counts (`setmaxnreg`), with the stack stores and loads of each stretch, so a spill can
be traced to the producer or a consumer. `--dump DIR` also writes the TTGIR, PTX and SASS for
reading.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as triton_driver

COMPILED: list = []


class _OfflineDriver:
    """Just enough of Triton's active CUDA driver for JIT specialization and compilation."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@contextlib.contextmanager
def offline_sm90(*kernels):
    """Inside: launches of `kernels` compile for sm_90 and record the result instead of running."""
    saved = [(k, k.run) for k in kernels]
    triton_driver.set_active(_OfflineDriver())

    def compile_only(kernel, original):
        def run(*args, grid, warmup, **kwargs):
            COMPILED.append(original(*args, grid=grid, warmup=True, **kwargs))

        return run

    for kernel, original in saved:
        kernel.run = compile_only(kernel, original)
        kernel.device_caches.clear()
    try:
        yield COMPILED
    finally:
        for kernel, original in saved:
            kernel.run = original
        # The stand-in driver stays: on a machine without a GPU there is no real one to restore.


def ptxas_report(ptx: str) -> str:
    """ptxas -v for sm_90a on `ptx`: the registers / spill / stack lines."""
    try:  # newer Triton bundles a second ptxas for sm_90 and up, and names it per target
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except ImportError:
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        result = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True,
        )  # fmt: skip
    lines = (result.stdout + result.stderr).splitlines()
    keep = [ln.strip() for ln in lines if re.search(r"registers|spill|stack|error|warn|fatal", ln)]
    return "\n".join(keep)


def partition_spills(cubin: bytes) -> list[tuple[str, int, int]]:
    """(stretch, stack stores, stack loads) of the kernel's SASS, cut at each `setmaxnreg`.

    A warp-specialized kernel sets its register count as each partition starts and ends
    (USETMAXREG: TRY_ALLOC raises it, DEALLOC lowers it), so a stretch after "24" is the
    producer's code, one after the consumers' count theirs (the default partition's, then the
    workers', in the order ptxas laid them out). STL / LDL are spill stores and loads."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    stretches = [["entry", 0, 0]]
    for line in sass.splitlines():
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if not found:
            continue
        address, instruction = found.groups()
        regs = re.search(r"USETMAXREG\.(\w+)\S* (?:UP\d, )?(0x[0-9a-f]+)", instruction)
        if regs:
            stretches.append([f"{int(regs[2], 16)} ({regs[1].lower()}) @{address}", 0, 0])
        stretches[-1][1] += bool(re.match(r"(@!?U?P\w+ )?STL\b", instruction))
        stretches[-1][2] += bool(re.match(r"(@!?U?P\w+ )?LDL\b", instruction))
    return [tuple(x) for x in stretches]


def _inputs(d, s, b=2, h=4, h_kv=2, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, s, h_kv, d, generator=g).to(dtype)
    v = torch.randn(b, s, h_kv, d, generator=g).to(dtype)
    return q, k, v


LAYOUTS = ("dense", "topleft", "seqlens", "varlen", "varlen_padded")
BWD_LAYOUTS = LAYOUTS  # the name the backward's callers know


def _layout_inputs(d: int, layout: str):
    """(q, k, v, geometry) of `layout`, one of LAYOUTS: "dense" (a causal mask bottom-right
    aligned), "topleft" (dense, top-left), "seqlens" (right-padded), "varlen", "varlen_padded"
    (varlen with gaps); each is a separate specialization of the kernels."""
    from fusedlayers.kernels._common import launch_geometry

    q, k, v = _inputs(d, 1024)
    seq = {}
    if layout == "seqlens":
        seq = dict(seqlens_q=torch.tensor([1000, 777], dtype=torch.int32),
                   seqlens_k=torch.tensor([1000, 777], dtype=torch.int32))  # fmt: skip
    elif layout.startswith("varlen"):
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu = torch.tensor([0, 1000, 1777], dtype=torch.int32)
        seq = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1024, max_seqlen_k=1024)
        if layout == "varlen_padded":
            offsets = torch.tensor([0, 1024, 2048], dtype=torch.int32)
            seq.update(seq_offsets_q=offsets, seq_offsets_k=offsets)
    return q, k, v, launch_geometry(q, k, **seq)


def compile_forward(
    d: int, causal: bool, persistent: bool = False, layout: str = "dense", d_v: int | None = None
):  # fmt: skip
    """The forward at d (v's head dim d_v, default d); `persistent`: the persistent grid
    (`_flash_fwd_sm90.PERSISTENT`, and `PERSISTENT_CAUSAL` for causal launches); `layout`: one of
    LAYOUTS (`_layout_inputs`)."""
    from fusedlayers.kernels import _flash_fwd_sm90 as fwd

    q, k, v, geom = _layout_inputs(d, layout)
    if d_v is not None and d_v != d:  # v narrower than q/k, laid out as v is
        v = torch.randn(*v.shape[:-1], d_v, dtype=v.dtype)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = torch.empty(q.shape[-2], q.shape[0]) if geom.varlen else torch.empty(
        q.shape[0], q.shape[2], q.shape[1])  # fmt: skip
    table = fwd.PERSISTENT_CAUSAL if causal else fwd.PERSISTENT
    width = fwd.widths(d, v.shape[-1])[0]  # the tables are per tile width
    default = table[width]
    table[width] = persistent
    try:
        with offline_sm90(fwd._attn_fwd_sm90):
            fwd.forward_sm90(
                q, k, v, out, lse, geom,
                softmax_scale=d**-0.5, causal=causal, bottom_right=layout != "topleft",
            )  # fmt: skip
    finally:
        table[width] = default
    return COMPILED[-1]


def compile_backward(
    d: int, causal: bool, block_m: int | None = None, layout: str = "dense",
    dq_first: bool | None = None, d_v: int | None = None, variant: str | None = None,
):  # fmt: skip
    """The backward at d (v's head dim d_v, default d; 80 and 96 on 128-wide tiles, 192 on
    256-wide ones: the tables are per `tile_width`), with the
    default tiles or (block_m given) those of `TILES[width]` or `TILES_M128[width]` whose
    BLOCK_M is block_m. `layout`: "dense" (a causal mask bottom-right
    aligned), "topleft" (dense, top-left), "seqlens" (right-padded), "varlen", "varlen_padded"
    (varlen with gaps): each is a separate specialization of the kernel (`_layout_inputs`).
    `dq_first`: the step's product order (`DQ_BEFORE_DK`; None: the default). `variant`: the
    wide schedule's variants to run (`WIDE_VARIANTS` names joined by "+", "none" for none;
    None: those `WIDE_DEFAULTS` runs at the dims)."""
    from fusedlayers.kernels import _flash_bwd_sm90 as bwd

    width = bwd.tile_width(d)
    if variant is not None:
        dims = (d, d if d_v is None else d_v)
        saved = bwd.WIDE_DEFAULTS.get(dims)
        bwd.WIDE_DEFAULTS[dims] = () if variant == "none" else tuple(variant.split("+"))
        try:
            return compile_backward(d, causal, block_m, layout, dq_first, d_v)
        finally:
            if saved is None:
                del bwd.WIDE_DEFAULTS[dims]
            else:
                bwd.WIDE_DEFAULTS[dims] = saved
    default, default_order = bwd.TILES[width], bwd.DQ_BEFORE_DK[width]
    if block_m is not None and block_m != default[0]:
        bwd.TILES[width] = bwd.TILES_M128[width]
        assert bwd.TILES[width][0] == block_m, (d, block_m)
    if dq_first is not None:
        bwd.DQ_BEFORE_DK[width] = dq_first
    try:
        return _compile_backward(bwd, d, causal, layout, d_v)
    finally:
        bwd.TILES[width], bwd.DQ_BEFORE_DK[width] = default, default_order


def _compile_backward(bwd, d: int, causal: bool, layout: str, d_v: int | None = None):
    q, k, v, geom = _layout_inputs(d, layout)
    if d_v is not None and d_v != d:  # v narrower than q/k, laid out as v is
        v = torch.randn(*v.shape[:-1], d_v, dtype=v.dtype)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    lse = torch.randn(q.shape[-2], q.shape[0]) if geom.varlen else torch.randn(
        q.shape[0], q.shape[2], q.shape[1])  # fmt: skip
    delta = torch.randn_like(lse)
    dk, dv = torch.empty_like(k), torch.empty_like(v)  # fresh: contiguous, as the backward's
    with offline_sm90(bwd._attn_bwd_sm90):
        bwd.backward_sm90(
            q, k, v, dout, lse, delta, bwd.dq_accumulator(q, width=bwd.tile_width(d)), dk, dv,
            geom,
            softmax_scale=d**-0.5, causal=causal, bottom_right=layout != "topleft",
        )  # fmt: skip
    return COMPILED[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="fwd,bwd")
    p.add_argument("--dims", default="128,64")
    p.add_argument("--causal", default="0,1")
    p.add_argument(
        "--bwd-block-m",
        default="default",
        help="backward BLOCK_M values to compile per head dim, e.g. 64,128 (d = 64 "
        "has a 128-row variant, _flash_bwd_sm90.TILES_M128); default: TILES",
    )
    p.add_argument(
        "--bwd-layouts",
        default="dense",
        help=f"backward specializations to compile, from {','.join(BWD_LAYOUTS)}",
    )
    p.add_argument(
        "--bwd-dq-first",
        default="default",
        help="backward product orders to compile: 1 (dQ before dK), 0 (dK first); "
        "default: DQ_BEFORE_DK",
    )
    p.add_argument(
        "--bwd-variants",
        default="default",
        help="wide-schedule variant sets to compile (d >= 160): default (the dims' "
        "_flash_bwd_sm90.WIDE_DEFAULTS), none, or _flash_bwd_sm90.WIDE_VARIANTS names joined "
        "by +, e.g. default,none,split_ring,dv_early,split_ring+dv_early; sets that do not "
        "fit at a dims pair (wide_variant_fits) are skipped",
    )
    p.add_argument(
        "--fwd-persistent",
        default="0",
        help="forward grids to compile: 0 (one tile per program), 1 (persistent)",
    )
    p.add_argument(
        "--fwd-layouts",
        default="dense",
        help=f"forward specializations to compile, from {','.join(LAYOUTS)}",
    )
    p.add_argument(
        "--partitions",
        action="store_true",
        help="also count spill stores / loads per partition (SASS cut at each setmaxnreg)",
    )
    p.add_argument("--dump", default=None)
    args = p.parse_args()
    for name in args.kernels.split(","):
        for dims in args.dims.split(","):  # "192" or "192x128" (d_qk x d_v)
            d, _, d_v = dims.partition("x")
            d, d_v = int(d), int(d_v or d)
            for causal in (bool(int(x)) for x in args.causal.split(",")):
                if name == "fwd":
                    for persistent in (bool(int(x)) for x in args.fwd_persistent.split(",")):
                        for layout in args.fwd_layouts.split(","):
                            kernel = compile_forward(d, causal, persistent, layout, d_v)
                            tag = ("-persistent" if persistent else "") + (
                                "" if layout == "dense" else f"-{layout}")  # fmt: skip
                            _report(args, name, dims, causal, tag, kernel)
                    continue
                orders = [None] if args.bwd_dq_first == "default" else [
                    bool(int(x)) for x in args.bwd_dq_first.split(",")]  # fmt: skip
                for block_m in _block_ms(name, d, args.bwd_block_m):
                    for layout in args.bwd_layouts.split(","):
                        for dq_first in orders:
                            for variant in _variants(d, d_v, args.bwd_variants):
                                kernel = compile_backward(
                                    d, causal, block_m, layout, dq_first, d_v, variant
                                )
                                tag = (f"-m{block_m}" if block_m else "") + (
                                    "" if layout == "dense" else f"-{layout}") + (
                                    "" if dq_first is None else f"-dqfirst{int(dq_first)}") + (
                                    "" if variant is None else f"-{variant}")  # fmt: skip
                                _report(args, name, dims, causal, tag, kernel)


def _variants(d: int, d_v: int, spec: str) -> list:
    """The wide-schedule variant sets of --bwd-variants that fit at (d, d_v) (None: the
    default); only the default below 256-wide tiles."""
    from fusedlayers.kernels import _flash_bwd_sm90 as bwd

    chosen = []
    for entry in spec.split(","):
        names = [] if entry in ("default", "none") else entry.split("+")
        if entry == "default":
            chosen.append(None)
        elif bwd.tile_width(d) > 128 and all(bwd.wide_variant_fits(n, d, d_v) for n in names):
            chosen.append(entry)
    return chosen


def _block_ms(name: str, d: int, spec: str) -> list:
    """The backward BLOCK_M values of --bwd-block-m that d has (None: the default tiles)."""
    if name != "bwd" or spec == "default":
        return [None]
    from fusedlayers.kernels import _flash_bwd_sm90 as bwd

    width = bwd.tile_width(d)
    have = {bwd.TILES[width][0]} | (
        {bwd.TILES_M128[width][0]} if width in bwd.TILES_M128 else set())  # fmt: skip
    return [m for m in (int(x) for x in spec.split(",")) if m in have] or [None]


def _report(args, name, d: int | str, causal, tag, kernel) -> None:
    """Print ptxas' report on `kernel`; with --dump, write its TTGIR, PTX and cubin as
    DIR/{name}-d{d}-c{causal}{tag}.*"""
    smem = kernel.metadata.shared
    print(f"== {name} d={d} causal={int(causal)}{tag}: shared {smem} bytes")
    print(ptxas_report(kernel.asm["ptx"]))
    if args.partitions:
        for stretch, stores, loads in partition_spills(kernel.asm["cubin"]):
            print(f"  setmaxnreg {stretch}: {stores} spill stores, {loads} spill loads")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        stem = os.path.join(args.dump, f"{name}-d{d}-c{int(causal)}{tag}")
        for ext in ("ttgir", "ptx"):
            with open(f"{stem}.{ext}", "w") as f:
                f.write(kernel.asm[ext])
        with open(f"{stem}.cubin", "wb") as f:
            f.write(kernel.asm["cubin"])


if __name__ == "__main__":
    main()
