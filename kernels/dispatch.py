"""Which kernels run an attention call: the Hopper (sm_90) Gluon kernels or the portable ones.

The portable Triton kernels (`_flash_fwd.py`, `_flash_bwd.py`) run everything, on any CUDA GPU and
under the CPU interpreter. On an sm_90 GPU the warp-specialized kernels (`_flash_fwd_sm90.py`;
`_flash_bwd_sm90.py`, one launch for dQ, dK and dV) take the calls they cover where they
measured faster; every other call falls back. Callers never choose: results are the same on
either path.

Choosing by hand:
- `FUSEDLAYERS_ATTENTION_PATH` (read at import) sets both passes: "auto" (the default),
  "portable" or "sm90"; "forward=sm90,backward=portable" sets them apart.
- `set_forward_path` / `set_backward_path` change them within a process (tests, benchmarks).
"sm90" still falls back where the sm_90 kernels do not cover a call; it only skips the length
tables below.

Every call the sm_90 kernels could run on this GPU but do not take logs why, once per launch
plan, on the `fusedlayers.kernels` logger at DEBUG level.

The Gluon modules load on the first call that reaches an sm_90 GPU (`sm90_kernels`): Gluon's
import takes about 0.1 s, which a CPU or an older GPU would pay in `import fusedlayers` for
kernels it cannot run.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from . import _compat
from ._common import cdiv, empty, multiprocessors, zeros

PATHS = ("auto", "portable", "sm90")
ENV = "FUSEDLAYERS_ATTENTION_PATH"
_log = logging.getLogger("fusedlayers.kernels")

# The shortest key length (per sequence) at which "auto" takes an sm_90 kernel, per head dim;
# None: "auto" never does. Below it the portable kernels measured as fast or faster on the H100
# (bf16, b*s = 16k tokens; docs/performance.md, "When each path runs").
# By d_qk: (192, 128) reads 192's. At 80-192 the sm_90 forward ran 1.3-2.7x the portable one at
# 4k and 16k keys on an H200 (bench/attention-head-dims.json).
SM90_MIN_KEYS: dict[int, int | None] = {
    128: 1024, 64: 2048, 256: 1024, 80: 1024, 96: 1024, 160: 1024, 192: 1024,
}  # fmt: skip
SM90_MIN_KEYS_CAUSAL: dict[int, int | None] = {
    128: 1024, 64: 1024, 256: 1024, 80: 1024, 96: 1024, 160: 1024, 192: 1024,
}  # fmt: skip
# The backward's, by d_qk: 80 and 96 run on d = 128's tiles and take its threshold (not measured
# apart yet). 160, 192 (with d_v 192 or 128) and 256 run the 256-wide schedule: 0.53-1.02x
# cuDNN from 1k to 16k keys on an H200, where the portable backward ran 0.33-0.67x
# (bench/attention-head-dims-bwd-wide.json).
SM90_BWD_MIN_KEYS: dict[int, int | None] = {
    128: 1024, 64: 4096, 80: 1024, 96: 1024, 160: 1024, 192: 1024, 256: 1024,
}  # fmt: skip
# "auto" also wants this many waves of sm_90 backward programs (one per 128 keys, 64 above
# d = 128, of each sequence and KV head; a wave is one program per SM), by tile width:
# (causal launches, others). Unlike the portable dK/dV pass, which deals a GQA group over
# several programs when there are few, it keeps one program per key block, whose loop visits
# s_q x (h / h_kv) query rows. On an H200 (bf16 forward+backward, GQA and MQA, 1-4 sequences;
# bench/h200-2026-11-29/backward-waves.json, examples/perf/backward_waves.py), with loops of
# 16k rows or more: causal launches, whose key blocks hold unequal work, ran 0.44-1.00x the
# portable backward's speed up to 2.9 waves and 1.08-1.54x from 3.9; others 1.15-1.31x from
# one wave at d = 64 and 128 (0.79x at half a wave), and 1.15-1.77x at every count measured
# above d = 128, from 64 programs.
SM90_BWD_MIN_WAVES: dict[int, tuple[float, float]] = {64: (3, 0.9), 128: (3, 0.9), 256: (3, 0)}
# Up to d = 128, shorter loops keep 4 waves for both: at 2k rows the sm_90 backward ran
# 0.66-0.95x the portable one from 1 to 2 waves, and causal 0.85x at 3.9.
SM90_BWD_SHORT_LOOP_ROWS, SM90_BWD_SHORT_LOOP_WAVES = 16384, 4


def _parse(value: str) -> dict[str, str]:
    """{"forward": path, "backward": path} from the environment variable's value."""
    value = value.strip() or "auto"
    if value in PATHS:
        return {"forward": value, "backward": value}
    paths = {"forward": "auto", "backward": "auto"}
    for part in value.split(","):
        name, _, path = part.partition("=")
        if name.strip() not in paths or path.strip() not in PATHS:
            raise ValueError(
                f"{ENV}={value!r}: expected one of {PATHS}, or forward=<path>,backward=<path>"
            )
        paths[name.strip()] = path.strip()
    return paths


_paths = _parse(os.environ.get(ENV, ""))


def _set(which: str, path: str) -> str:
    if path not in PATHS:
        raise ValueError(f"{which} path must be one of {PATHS}, got {path!r}")
    previous, _paths[which] = _paths[which], path
    return previous


def set_forward_path(path: str) -> str:
    """Pin the forward kernel ("auto", "portable" or "sm90"); returns the previous setting."""
    return _set("forward", path)


def set_backward_path(path: str) -> str:
    """Pin the backward kernels ("auto", "portable" or "sm90"); returns the previous setting."""
    return _set("backward", path)


def forward_path() -> str:
    return _paths["forward"]


def backward_path() -> str:
    return _paths["backward"]


@functools.cache
def sm90_kernels(name: str):
    """The sm_90 kernel module `name` ("_flash_fwd_sm90" or "_flash_bwd_sm90"), imported on
    first use."""
    return importlib.import_module(f"{__package__}.{name}")


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _on_sm90(t: torch.Tensor) -> bool:
    if t.device.type != "cuda" or _compat.INTERPRETER:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _is_sm90(index)


def _not_covered(module, q, k, v, window_left, window_right, bias, alibi_slopes, softcap,
                 dropout_p) -> str | None:  # fmt: skip
    """Why the sm_90 kernels of `module` cannot run this call, or None when they can: fp16/bf16
    (not fp8), (d_qk, d_v) in `module.SUPPORTED_DIMS`, no mask or a causal one (window (-1, -1)
    or (-1, 0)), and no bias, ALiBi, softcap or dropout."""
    if torch.float8_e4m3fn in (q.dtype, k.dtype, v.dtype):
        return "fp8 (float8_e4m3fn) inputs, which only the portable forward takes"
    if not module.GLUON_AVAILABLE:
        return "Triton's Gluon is not available"
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (fp16 or bf16, all alike)"
    if (q.shape[-1], v.shape[-1]) not in module.SUPPORTED_DIMS:
        return f"head dims {q.shape[-1]}, {v.shape[-1]} ((d_qk, d_v) in {module.SUPPORTED_DIMS})"
    for name, present in (("a bias", bias is not None), ("ALiBi", alibi_slopes is not None),
                          ("softcap", softcap > 0), ("dropout", dropout_p > 0)):  # fmt: skip
        if present:
            return name
    if window_left != -1 or window_right not in (-1, 0):
        return f"window ({window_left}, {window_right}) (no mask or causal only)"
    return None


def _too_short(min_keys: int | None, geom) -> str | None:
    """Why "auto" leaves a call to the portable kernels by its key length, or None."""
    if min_keys is None:
        return "not measured faster at this head dim: only an explicit setting takes it"
    if geom.k.max_len < min_keys:
        return f"{geom.k.max_len} keys, fewer than the {min_keys} it measured faster from"
    return None


def _decide(which: str, why: str | None, views_of):
    """The TMA views `views_of()` makes when nothing above declined the call and TMA can read
    the storage in place, else None, with the reason logged at DEBUG."""
    views = views_of() if why is None else None
    if why is None and views is None:
        why = "TMA cannot read the inputs in place (strides or alignment)"
    if why is not None:
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("the sm_90 %s does not take this call: %s", which, why)
        return None
    return views


def sm90_forward_plan(
    q, k, v, geom, *, window_left, window_right, bias, alibi_slopes, softcap, dropout_p
):  # fmt: skip
    """(TMA views, causal) when the sm_90 forward should run this call, else None: a call
    `_not_covered` accepts, at least `SM90_MIN_KEYS` keys under "auto", in storage TMA can read
    in place (`plan_views`)."""
    if _paths["forward"] == "portable" or not _on_sm90(q):
        return None
    sm90 = sm90_kernels("_flash_fwd_sm90")
    why = _not_covered(sm90, q, k, v, window_left, window_right, bias, alibi_slopes, softcap,
                       dropout_p)  # fmt: skip
    if why is None and _paths["forward"] == "auto":
        table = SM90_MIN_KEYS_CAUSAL if window_right == 0 else SM90_MIN_KEYS
        why = _too_short(table[q.shape[-1]], geom)
    views = _decide("forward", why, lambda: sm90.plan_views(q, k, v, geom.varlen))
    return None if views is None else (views, window_right == 0)


def run_sm90_forward(q, k, v, geom, *, causal, softmax_scale, bottom_right, signature=None):
    """The sm_90 forward of a call `sm90_forward_plan` sends there: (out, lse), allocated here.
    `signature`: the call's `_common.attention_signature`, for the launch.

    Rows that may see no key (padding, varlen, or a bottom-right causal diagonal with more
    queries than keys) are never written by the kernel, so out / lse start as 0 / -inf there.
    """
    out_shape = (*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[1], q.shape[0]) if geom.varlen else (q.shape[0], q.shape[2], q.shape[1])
    empty_rows = causal and bottom_right and geom.q.max_len > geom.k.max_len
    if geom.dense and not empty_rows:
        out = empty(out_shape, q.dtype, q.device)
        lse = empty(lse_shape, torch.float32, q.device)
    else:
        out = zeros(out_shape, q.dtype, q.device)
        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    sm90_kernels("_flash_fwd_sm90").forward_sm90(
        q, k, v, out, lse, geom,
        softmax_scale=softmax_scale, causal=causal, bottom_right=bottom_right, signature=signature,
    )  # fmt: skip
    return out, lse


def sm90_backward_plan(
    q, k, v, dout, lse, geom, *, window_left, window_right, bias, alibi_slopes, softcap,
    dropout_p, deterministic,
):  # fmt: skip
    """(TMA views, causal) when the sm_90 backward should run this call, else None: a call
    `_not_covered` accepts, with dout in q's dtype, a contiguous LSE and `deterministic=False`
    (its dQ is summed with fp32 atomics, so it is not bitwise reproducible; dK and dV are);
    under "auto" at least `SM90_BWD_MIN_KEYS` keys and `SM90_BWD_MIN_WAVES` waves of programs
    (by tile width, causal or not; more for short loops up to d = 128);
    storage TMA can read in place."""
    if _paths["backward"] == "portable" or not _on_sm90(q):
        return None
    sm90 = sm90_kernels("_flash_bwd_sm90")
    why = _not_covered(sm90, q, k, v, window_left, window_right, bias, alibi_slopes, softcap,
                       dropout_p)  # fmt: skip
    if why is None and deterministic:
        why = "deterministic=True (its dQ sums with atomics)"
    if why is None and (dout.dtype != q.dtype or not lse.is_contiguous()):
        why = f"dout {dout.dtype} against q {q.dtype}, or a strided LSE"
    if why is None and _paths["backward"] == "auto":
        why = _too_short(SM90_BWD_MIN_KEYS[q.shape[-1]], geom)
        programs = cdiv(geom.k.max_len, sm90.block_n(q.shape[-1])) * geom.batch * k.shape[-2]
        width = sm90.tile_width(q.shape[-1])
        waves = SM90_BWD_MIN_WAVES[width][0 if window_right == 0 else 1]
        rows = geom.q.max_len * (q.shape[-2] // k.shape[-2])  # one program's loop
        if width <= 128 and rows < SM90_BWD_SHORT_LOOP_ROWS:
            waves = max(waves, SM90_BWD_SHORT_LOOP_WAVES)
        if why is None and programs < waves * multiprocessors(q.device):
            why = f"{programs} programs, under {waves} waves of the GPU's SMs"
    views = _decide("backward", why, lambda: sm90.plan_views(q, k, v, dout, geom.varlen))
    return None if views is None else (views, window_right == 0)
