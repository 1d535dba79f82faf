"""Host (CPU) time per attention call: the front end, the op routing and the Triton launch.

Small problems are launch-bound: when the host needs longer to issue a call than the GPU needs to
run it, the GPU waits, and that wait is what a user sees. On CUDA this script times, on tiny
shapes where GPU time is negligible, the host time per call of `flash_attn_func` and of SDPA
(flash backend), on an sm_90 GPU also of the Hopper kernels (direct launcher against Triton's),
then profiles the fusedlayers call so the expensive Python frames are named (on an sm_90 GPU
also the pinned sm_90 forward).

`--stubbed` needs no GPU: the Triton launches are replaced by no-ops (CPU tensors, interpreter
mode), so what remains is fusedlayers' own host time; the commit history and
docs/performance.md quote its numbers.

    python examples/perf/launch_overhead.py    # CUDA: table, then the top frames by cumulative time
    python examples/perf/launch_overhead.py --stubbed
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import os
import pkgutil
import pstats
import time
from collections.abc import Callable

import torch


def host_us_per_call(fn: Callable[[], object], calls: int, repeats: int = 15) -> float:
    """Best mean host time of `fn` over `repeats` runs of `calls` calls, after a warm-up.

    Many short runs and their minimum: the benchmark host's Python speed moves by 30% within a
    minute (other work on the machine), and the minimum is the least disturbed reading."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return best * 1e6


def stub_launches(kernels=None) -> None:
    """Replace every Triton launch of `kernels` (a `fusedlayers.kernels` package; by default the
    installed one) by a no-op: attention, decode, norm, RoPE, activation and cache append. The
    launches through `_launch.launch` keep that function's own Python (its slot lookup) and get
    a kernel that does nothing; the two autotuned launches are skipped whole."""
    if kernels is None:
        import fusedlayers.kernels as kernels
    modules = {
        info.name: importlib.import_module(f"{kernels.__name__}.{info.name}")
        for info in pkgutil.iter_modules(kernels.__path__)
    }
    real_launch = modules["_launch"].launch

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    def no_kernel(kernel, grid, *args, **kwargs):
        return real_launch(NoLaunch(), grid, *args, **kwargs)

    for module in modules.values():  # `_launch` too: `launch_planned` calls its `launch`
        if getattr(module, "launch", None) is real_launch:
            module.launch = no_kernel
    # the forward's and the decode kernel's (autotuned) launches
    modules["_flash_fwd"]._launch = lambda *args: None
    modules["_flash_decode"]._launch = lambda *args: None


# The eager decode step the host-time scripts time (this one and host_ab.py): one query, 4 query
# heads over 2 KV heads, d=64, a 1,024-row cache holding DECODE_FILLED rows.
DECODE_FILLED = 700


def decode_step(device, dtype) -> tuple[torch.Tensor, ...]:
    """(q [1, 1, 4, 64], k_cache, v_cache [1, 1024, 2, 64], int32 lengths [1] = DECODE_FILLED)."""
    q = torch.randn(1, 1, 4, 64, device=device, dtype=dtype)
    k_cache, v_cache = (torch.randn(1, 1024, 2, 64, device=device, dtype=dtype) for _ in range(2))
    lengths = torch.full((1,), DECODE_FILLED, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, lengths


def sdpa_decode_calls(q, k_cache, v_cache) -> tuple[Callable, Callable]:
    """SDPA (its own dispatch) on the same step: given the cache cut to its filled rows (what an
    eager loop with a host-side length passes), and given the whole static cache with a boolean
    mask over the filled rows (what a captured or compiled loop passes)."""
    import torch.nn.functional as F

    filled = torch.arange(k_cache.shape[1], device=q.device) < DECODE_FILLED
    mask = filled[None, None, None, :]
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k_cache, v_cache))

    def cut():
        return F.scaled_dot_product_attention(
            q_t, k_t[:, :, :DECODE_FILLED], v_t[:, :, :DECODE_FILLED], enable_gqa=True
        )

    def masked():
        return F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, enable_gqa=True)

    return cut, masked


def decode_rows(device, dtype, calls: int) -> list[tuple[str, float]]:
    """One eager decode step's attention (b=1, one query, 4 query heads over 2 KV heads, d=64,
    1,024 cached keys, split-KV with the heuristic's split count): the kernel entry
    `decode_attention` alone, and `flash_attn_with_kvcache` around it (validation; the lengths
    are read from the device once per tensor version, as the layers of one decode step share
    them), and the same with the lengths edited in place before every call (`add_(0)`: a new
    version, so a host read each call, as in a one-layer model); on CUDA also SDPA (its own
    dispatch) on the same step, given the cache cut to its filled rows and given the whole cache
    with a boolean mask."""
    from fusedlayers.kernels import decode_attention

    import fusedlayers

    q, k_cache, v_cache, seqlens = decode_step(device, dtype)

    def entry():
        return decode_attention(q, k_cache, v_cache, seqlens, softmax_scale=0.125)

    def api():
        return fusedlayers.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, causal=True
        )

    def api_new_lengths():
        seqlens.add_(0)
        return api()

    rows = [
        ("decode_attention (kernel entry), 1 query, 1k cache", host_us_per_call(entry, calls)),
        ("flash_attn_with_kvcache, same call", host_us_per_call(api, calls)),
        (
            "flash_attn_with_kvcache, lengths edited in place before each call",
            host_us_per_call(api_new_lengths, calls),
        ),
    ]
    if q.is_cuda:
        sdpa_cut, sdpa_masked = sdpa_decode_calls(q, k_cache, v_cache)
        rows += [
            ("sdpa, same decode step, cache cut to its filled rows",
             host_us_per_call(sdpa_cut, calls)),
            ("sdpa, same decode step, whole cache and a boolean mask",
             host_us_per_call(sdpa_masked, calls)),
        ]  # fmt: skip
    return rows


def sm90_backward_parts() -> tuple:
    """The sm_90 backward's pieces `backward_breakdown` times, as (module, attribute name):
    each is looked up where the launcher calls it, so a renamed one fails here, not on a GPU."""
    from fusedlayers.kernels import _flash_bwd, _flash_bwd_sm90

    return (
        (_flash_bwd, "_preprocess"),
        (_flash_bwd, "_new_grad"),
        (_flash_bwd, "_scaled_dq"),
        (_flash_bwd, "call_signature"),
        (_flash_bwd_sm90, "backward_sm90"),
        (_flash_bwd_sm90, "dq_accumulator"),
        # a bound launch (every call after the first); `launch` runs only until it binds
        (_flash_bwd_sm90, "launch_bound"),
    )


def sm90_rows(calls: int, top: int) -> tuple[list[tuple[str, float]], str]:
    """The Hopper kernels' host time (sm_90 GPUs with Gluon only): a causal forward and
    forward+backward pinned to the sm_90 kernels, on a shape small enough for the GPU to
    finish first (b=1, s=2048, one head, d=128), through the direct launcher and through
    Triton's `kernel[grid]`, beside SDPA-flash on the same shape; a profile of the
    forward without grad by own time (its frames, not autograd's); the backward's breakdown
    (`backward_breakdown`, with the sm_90 backward's pieces timed); and torch.profiler's table
    of a forward+backward by self CPU time, which also names the CUDA runtime calls and
    autograd's own work."""
    import torch.nn.functional as F
    from fusedlayers.kernels import (
        _flash_fwd_sm90,
        set_backward_path,
        set_forward_path,
    )
    from fusedlayers.kernels._launch import set_direct_launch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fusedlayers

    if torch.cuda.get_device_capability() != (9, 0) or not _flash_fwd_sm90.GLUON_AVAILABLE:
        return [], ""
    q, k, v = (
        torch.randn(1, 2048, 1, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            return fusedlayers.flash_attn_func(q, k, v, causal=True)

    def fwd_grad():
        return fusedlayers.flash_attn_func(q, k, v, causal=True)

    def fwdbwd():
        torch.autograd.grad(fusedlayers.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)

    def sdpa_fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
            )

    def sdpa_fwdbwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True
            )
        torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))

    rows = []
    paths = set_forward_path("sm90"), set_backward_path("sm90")
    try:
        for direct in (True, False):
            previous = set_direct_launch(direct)
            how = "direct launcher" if direct else "Triton's launcher"
            rows += [
                (f"sm_90 kernels, s=2k d=128: fwd, no grad ({how})", host_us_per_call(fwd, calls)),
                (
                    f"sm_90 kernels, s=2k d=128: fwd, inputs require grad ({how})",
                    host_us_per_call(fwd_grad, calls),
                ),
                (f"sm_90 kernels, s=2k d=128: fwd+bwd ({how})", host_us_per_call(fwdbwd, calls)),
            ]
            set_direct_launch(previous)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fwd()
        profile.disable()
        breakdown, backward_profile = backward_breakdown(
            *(t.detach() for t in (q, k, v)), dout, calls, top, sm90_backward_parts()
        )
        rows += [(f"sm_90 kernels, s=2k d=128: {name.strip()}", us) for name, us in breakdown]
        for _ in range(20):
            fwdbwd()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                fwdbwd()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    finally:
        set_forward_path(paths[0])
        set_backward_path(paths[1])
    rows.append(("sdpa-flash, s=2k d=128: fwd, no grad", host_us_per_call(sdpa_fwd, calls)))
    rows.append(("sdpa-flash, s=2k d=128: fwd+bwd", host_us_per_call(sdpa_fwdbwd, calls)))
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    text.write("\nThe sm_90 backward on autograd's device thread, by own time:\n")
    text.write(backward_profile)
    text.write(f"\ntorch.profiler, {calls} sm_90 forward+backward calls, by self CPU time:\n")
    text.write(table)
    return rows, text.getvalue()


def backward_breakdown(q, k, v, dout, calls: int, top: int, parts: tuple = ()) -> tuple[list, str]:
    """Where the backward's host time goes, and a floor for it.

    Rows: a no-op autograd `Function` over the same tensors (autograd's own cost: the handoff to
    its device thread and back), SDPA-flash's backward, our whole autograd backward, and inside
    it the `Function.backward`, the launcher `flash_attention_backward` and each Triton launch;
    then the launcher called directly from this thread. The wrappers time the calls as they
    are: they wrap `_flash_bwd.launch_planned`, so every launch keeps the direct launcher
    (wrapping the kernels instead would send them through Triton's own `kernel[grid]` path).
    The second value is a cProfile of the backward as autograd runs it, on its device thread (a
    profiler follows one thread: it is switched on inside the backward), taken in a separate
    pass so its own cost stays out of the timed rows.

    `parts`: more functions to time inside the launcher, as (module, attribute name) pairs
    (the sm_90 backward's pieces: `sm90_backward_parts`); each is wrapped where the launcher
    looks it up."""
    import torch.nn.functional as F
    from fusedlayers.kernels import _flash_bwd, attention_ops
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fusedlayers

    spent: dict[str, float] = {}
    profile = cProfile.Profile()
    profiling = False

    def timed(name: Callable[..., str] | str, fn: Callable, profiled: bool = False) -> Callable:
        def run(*args, **kwargs):
            key = name if isinstance(name, str) else name(*args)
            if profiled and profiling:
                profile.enable()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start
                if profiled and profiling:
                    profile.disable()

        return run

    class NoOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None

    def launch_name(kernel, *args) -> str:
        return f"launch {getattr(kernel, 'fn', kernel).__name__}"

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fusedlayers.flash_attn_func(*leaves, causal=True)
    noop_out = NoOp.apply(*leaves)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa_out = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in leaves), is_causal=True
        )
    rows = [
        ("no-op autograd Function, backward only", host_us_per_call(
            lambda: torch.autograd.grad(noop_out, leaves[0], dout, retain_graph=True), calls)),
        ("sdpa-flash backward only", host_us_per_call(
            lambda: torch.autograd.grad(sdpa_out, leaves, dout.transpose(1, 2),
                                        retain_graph=True), calls)),
    ]  # fmt: skip

    eager = attention_ops._EagerFlashAttention
    saved = (_flash_bwd.launch_planned, attention_ops.flash_attention_backward, eager.backward)
    saved_parts = [(module, name, getattr(module, name)) for module, name in parts]
    try:
        for module, name, fn in saved_parts:
            setattr(module, name, timed(f"part {name}", fn))
        _flash_bwd.launch_planned = timed(launch_name, saved[0])
        attention_ops.flash_attention_backward = timed("launcher", saved[1])
        eager.backward = staticmethod(timed("Function.backward", saved[2], profiled=True))
        backward = lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)  # noqa: E731
        for _ in range(20):
            backward()
        spent.clear()
        total = host_us_per_call(backward, calls, repeats=1)
        # host_us_per_call ran 20 warm-up calls before the timed ones.
        inside = {name: s / (calls + 20) * 1e6 for name, s in spent.items()}
        spent.clear()
        args = [t.detach() for t in (dout, q, k, v, out)]
        lse = attention_ops._forward_impl(*(t.detach() for t in (q, k, v)), *[None] * 8,
                                          q.shape[-1] ** -0.5, -1, 0, True, None, None,
                                          0.0, 0.0, None, False)[1]  # fmt: skip
        launcher = attention_ops.flash_attention_backward
        direct = host_us_per_call(
            lambda: launcher(*args, lse, softmax_scale=q.shape[-1] ** -0.5, window_right=0),
            calls,
            repeats=1,
        )
        direct_inside = {name: s / (calls + 20) * 1e6 for name, s in spent.items()}
        profiling = True
        for _ in range(calls):
            backward()
    finally:
        _flash_bwd.launch_planned, attention_ops.flash_attention_backward = saved[:2]
        eager.backward = staticmethod(saved[2])
        for module, name, fn in saved_parts:
            setattr(module, name, fn)

    def nested(times: dict) -> list:  # outermost first: Function.backward, launcher, launches
        depth = {"Function.backward": 1, "launcher": 2}
        names = sorted(times, key=lambda name: (depth.get(name, 3), name))
        return [("  " * depth.get(n, 3) + f"inside: {n}", times[n]) for n in names]

    rows.append(("fusedlayers backward only, through autograd", total))
    rows += nested(inside)
    rows.append(("flash_attention_backward called directly", direct))
    rows += nested(direct_inside)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return rows, text.getvalue()


def main(calls: int = 1000, top: int = 30, stubbed: bool = False) -> None:
    from fusedlayers.kernels._launch import set_direct_launch

    import fusedlayers

    if stubbed:
        stub_launches()
    device = "cpu" if stubbed else "cuda"
    dtype = torch.float16 if stubbed else torch.bfloat16
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 128, 4, 64, device=device, dtype=dtype) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def ours():
        return fusedlayers.flash_attn_func(q, k, v, causal=True)

    def ours_grad():
        return fusedlayers.flash_attn_func(qg, kg, vg, causal=True)

    def ours_fwdbwd():
        torch.autograd.grad(ours_grad(), (qg, kg, vg), dout)

    def on_calling_thread(fn: Callable[[], object]) -> Callable[[], object]:
        """fn with autograd's backward on this thread instead of its device thread."""

        def run():
            with torch.autograd.set_multithreading_enabled(False):
                return fn()

        return run

    rows = [
        ("fusedlayers fwd, no grad", host_us_per_call(ours, calls)),
        ("fusedlayers fwd, inputs require grad", host_us_per_call(ours_grad, calls)),
        ("fusedlayers fwd+bwd", host_us_per_call(ours_fwdbwd, calls // 2)),
        (
            "fusedlayers fwd+bwd, backward on the calling thread",
            host_us_per_call(on_calling_thread(ours_fwdbwd), calls // 2),
        ),
    ]
    rows += decode_rows(device, dtype, calls)
    if not stubbed:  # the same calls with every launch through `kernel[grid]` (Triton's path)
        previous = set_direct_launch(False)
        rows += [
            ("  same, Triton's launcher: fwd, no grad", host_us_per_call(ours, calls)),
            (
                "  same, Triton's launcher: fwd, inputs require grad",
                host_us_per_call(ours_grad, calls),
            ),
            ("  same, Triton's launcher: fwd+bwd", host_us_per_call(ours_fwdbwd, calls // 2)),
        ]
        set_direct_launch(previous)
    if not stubbed:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(grad: bool = False):
            a, b, c = (t.transpose(1, 2) for t in ((qg, kg, vg) if grad else (q, k, v)))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(a, b, c, is_causal=True)
            if grad:
                torch.autograd.grad(out, (qg, kg, vg), dout.transpose(1, 2))

        def sdpa_requiring_grad():
            a, b, c = (t.transpose(1, 2) for t in (qg, kg, vg))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True)

        rows += [
            ("sdpa-flash fwd, no grad", host_us_per_call(sdpa, calls)),
            ("sdpa-flash fwd, inputs require grad", host_us_per_call(sdpa_requiring_grad, calls)),
            ("sdpa-flash fwd+bwd", host_us_per_call(lambda: sdpa(True), calls // 2)),
            (
                "sdpa-flash fwd+bwd, backward on the calling thread",
                host_us_per_call(on_calling_thread(lambda: sdpa(True)), calls // 2),
            ),
        ]
        breakdown, worker_profile = backward_breakdown(q, k, v, dout, calls // 2, top)
        rows += breakdown
        sm90, sm90_profile = sm90_rows(calls // 2, top)
        rows += sm90
    print(f"| call ({'launches stubbed, CPU' if stubbed else 'CUDA'}) | host us/call |")
    print("|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        ours_fwdbwd()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
    print(text.getvalue())
    if not stubbed:
        print("The backward on autograd's device thread, by own time:")
        print(worker_profile)
        if sm90_profile:
            print("The sm_90 forward without grad (s=2k d=128, pinned), by own time:")
            print(sm90_profile)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--stubbed", action="store_true", help="CPU, Triton launches as no-ops")
    args = parser.parse_args()
    if args.stubbed:
        # Read when triton.jit decorates the kernels, i.e. at the first fusedlayers import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    main(args.calls, args.top, args.stubbed)
