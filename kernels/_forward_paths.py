"""Which forward kernel runs a call: the Hopper (sm_90) Gluon kernel or the portable one.

The portable Triton kernel (`_flash_fwd.py`) runs everything, on any CUDA GPU and under the CPU
interpreter. On an sm_90 GPU the warp-specialized kernel (`_flash_fwd_sm90.py`) takes the calls it
covers and where it measured faster (`SM90_MIN_KEYS`, `SM90_MIN_KEYS_CAUSAL`); every other call
falls back, silently and correctly. Callers never choose: `flash_attention` behaves the same on
either path.

`set_forward_path("portable" | "sm90" | "auto")` pins the choice for tests and benchmarks.

The Gluon modules load on the first call that reaches an sm_90 GPU (`sm90_kernels`): Gluon's
import takes about 0.1 s, which a CPU or an older GPU would pay in `import fusedlayers` for
kernels it cannot run.
"""

from __future__ import annotations

import functools
import importlib

import torch

from . import _compat
from ._common import empty, zeros

_PATHS = ("auto", "portable", "sm90")
_path = "auto"

# Per head dim, the shortest key length (per sequence) at which "auto" takes the sm_90 kernel,
# without a mask and with a causal one; None: "auto" never does (set_forward_path("sm90") still
# can).
# Measured on the H100 through flash_attn_func (bf16, b*s = 16k tokens; docs/performance.md,
# "When each path runs" and "Warpgroups skip the key blocks they cannot see"):
# - d=128, since the persistent grids: 1.26-1.33x the portable kernel at s = 1k without a mask
#   (forward+backward 1.05-1.19x), 1.2x at 2k-4k; causal 1.16x at 1k (197 against 229 us a
#   forward; the 0.62x forward+backward a sweep once read there was host time, not the
#   kernels).
# - d=64 (three consumer warpgroups, `sm90.CONSUMERS`): 1.08-1.14x from 2k without a mask,
#   0.97x at 1k (the sweep's same-process portable column, 2026-11-27: 364 against 374 and 361
#   against 372 TFLOP/s); causal, since the upper warpgroups skip the key blocks they cannot
#   see, 1.14x at 2k (367 against 323) and 1.02-1.03x at 1k (272 against 266, 274 against 264).
SM90_MIN_KEYS: dict[int, int | None] = {128: 1024, 64: 2048}
SM90_MIN_KEYS_CAUSAL: dict[int, int | None] = {128: 1024, 64: 1024}


def set_forward_path(path: str) -> str:
    """Pin the forward kernel ("auto", "portable" or "sm90"); returns the previous setting.

    "sm90" still falls back to the portable kernel for calls the sm_90 kernel does not cover
    (`sm90_plan` returns None for them); it only skips the length table.
    """
    global _path
    if path not in _PATHS:
        raise ValueError(f"forward path must be one of {_PATHS}, got {path!r}")
    previous, _path = _path, path
    return previous


def forward_path() -> str:
    """The current setting of `set_forward_path`."""
    return _path


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


def sm90_plan(
    q, k, v, geom, *, window_left, window_right, bias, alibi_slopes, softcap, dropout_p
):  # fmt: skip
    """(TMA views, causal) when the sm_90 kernel should run this call, else None.

    Covered: fp16/bf16 on an sm_90 GPU, d_qk = d_v in `sm90.SUPPORTED_HEAD_DIMS`, no mask or a
    causal one (window (-1, -1) or (-1, 0)), no bias, ALiBi, softcap or dropout, and storage TMA
    can read in place (`sm90.tma_view`). Sliding windows and the score modifiers fall back.
    """
    if _path == "portable" or not _on_sm90(q):
        return None
    sm90 = sm90_kernels("_flash_fwd_sm90")
    if not sm90.GLUON_AVAILABLE:
        return None
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return None
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in sm90.SUPPORTED_HEAD_DIMS:
        return None
    if bias is not None or alibi_slopes is not None or softcap > 0 or dropout_p > 0:
        return None
    if window_left != -1 or window_right not in (-1, 0):
        return None
    table = SM90_MIN_KEYS_CAUSAL if window_right == 0 else SM90_MIN_KEYS
    min_keys = table[q.shape[-1]]
    if _path == "auto" and (min_keys is None or geom.k.max_len < min_keys):
        return None
    views = sm90.plan_views(q, k, v, geom.varlen)
    if views is None:
        return None
    return views, window_right == 0


def run_sm90(q, k, v, geom, *, causal, softmax_scale, bottom_right, signature=None):
    """The sm_90 forward of a call `sm90_plan` sends there: (out, lse), allocated here.
    `signature`: the call's `_common.attention_signature`, for the launch
    (`sm90.forward_sm90`).

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
