"""Which backward kernels run a call: the Hopper (sm_90) Gluon kernel or the portable ones.

The portable Triton backward (`_flash_bwd.py`: the two-pass scheme, or the atomic-dQ one) runs
everything, on any CUDA GPU and under the CPU interpreter. On an sm_90 GPU the warp-specialized
kernel (`_flash_bwd_sm90.py`, one launch for dQ, dK and dV) can take the calls it covers where it
measured faster (`SM90_BWD_MIN_KEYS`); every other call falls back, silently and correctly.

`set_backward_path("portable" | "sm90" | "auto")` pins the choice for tests and benchmarks, as
`set_forward_path` does for the forward; the two settings are independent. Like the forward's,
the sm_90 module loads on the first call that reaches an sm_90 GPU.
"""

from __future__ import annotations

import torch

from ._common import cdiv, multiprocessors
from ._forward_paths import _on_sm90, sm90_kernels

_PATHS = ("auto", "portable", "sm90")
_path = "auto"

# Per head dim, the shortest key length (per sequence) at which "auto" takes the sm_90 backward;
# None: "auto" never does (set_backward_path("sm90") still can). Measured on the H100 with
# examples/perf/tune_sm90_backward.py (bf16, b*s = 16k tokens, h*d = 2048, docs/performance.md,
# "The sm_90 backward"): with the TMA reduce of dQ, d=128 backward 1.04-1.11x the portable one at
# s = 1k and 2k, causal and not (shorter lengths not measured), and more from 4k on. d=64, with
# 128-row query steps (`_flash_bwd_sm90.TILES`): 0.81-0.86x the portable backward at 1k; since
# the dQ reduce's wait moved and P^T feeds dV from registers (2026-11-26), forward+backward
# 1.08x and 0.98x (causal) at 2k, 1.14x and 1.09x at 4k, 1.14-1.15x at 16k, so from 4k.
SM90_BWD_MIN_KEYS: dict[int, int | None] = {128: 1024, 64: 4096}
# "auto" also wants this many waves of programs (one per 128 keys of each sequence and KV head,
# one program per SM): the measured launches had 15; unlike the portable dK/dV pass, which
# deals a GQA group over several programs when there are few (`_flash_bwd.group_splits`), this
# kernel keeps one program per key block, so MQA with a small batch would leave SMs idle.
SM90_BWD_MIN_WAVES = 4


def set_backward_path(path: str) -> str:
    """Pin the backward kernels ("auto", "portable" or "sm90"); returns the previous setting.

    "sm90" still falls back to the portable backward for calls the sm_90 kernel does not cover
    (`sm90_backward_plan` returns None for them); it only skips the length table.
    """
    global _path
    if path not in _PATHS:
        raise ValueError(f"backward path must be one of {_PATHS}, got {path!r}")
    previous, _path = _path, path
    return previous


def backward_path() -> str:
    """The current setting of `set_backward_path`."""
    return _path


def sm90_backward_plan(
    q, k, v, dout, lse, geom, *, window_left, window_right, bias, alibi_slopes, softcap,
    dropout_p, deterministic,
):  # fmt: skip
    """(TMA views, causal) when the sm_90 backward should run this call, else None.

    Covered: fp16/bf16 on an sm_90 GPU, d_qk = d_v in `sm90.SUPPORTED_HEAD_DIMS`, no mask or a
    causal one (window (-1, -1) or (-1, 0)), no bias, ALiBi, softcap or dropout, storage TMA can
    read in place, and `deterministic=False`: its dQ is summed with fp32 atomics, so it is not
    bitwise reproducible (dK and dV are). The rest takes the portable backward.
    """
    if _path == "portable" or deterministic or not _on_sm90(q):
        return None
    sm90 = sm90_kernels("_flash_bwd_sm90")
    if not sm90.GLUON_AVAILABLE:
        return None
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return None
    if dout.dtype != q.dtype or not lse.is_contiguous():
        return None
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in sm90.SUPPORTED_HEAD_DIMS:
        return None
    if bias is not None or alibi_slopes is not None or softcap > 0 or dropout_p > 0:
        return None
    if window_left != -1 or window_right not in (-1, 0):
        return None
    if _path == "auto":
        min_keys = SM90_BWD_MIN_KEYS[q.shape[-1]]
        if min_keys is None or geom.k.max_len < min_keys:
            return None
        programs = cdiv(geom.k.max_len, sm90.BLOCK_N) * geom.batch * k.shape[-2]
        if programs < SM90_BWD_MIN_WAVES * multiprocessors(q.device):
            return None
    views = sm90.plan_views(q, k, v, dout, geom.varlen)
    if views is None:
        return None
    return views, window_right == 0
