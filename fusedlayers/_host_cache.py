"""Per-tensor, per-version memo for facts the front end reads off small index/mask tensors,
and for small tables derived from one (RoPE's cos/sin).

Reading a CUDA tensor's values (`tolist()`, `torch.equal`) stalls the host until the device
drains; a model hands the same `cu_seqlens` or padding mask to every layer, forward and backward,
so each fact is computed once per tensor and in-place version. Entries are keyed by `id()` and
trusted only while their weak reference still points at that tensor and its version counter is
unchanged; an entry goes when its tensor dies, before the id can be reused.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

_MEMO: dict[tuple[int, str], tuple[weakref.ref, int, Any]] = {}


def per_version(t: torch.Tensor, what: str, compute: Callable[[torch.Tensor], Any]) -> Any:
    """`compute(t)`, remembered under `what` until `t` is modified in place or dies.

    Tensors made under `torch.inference_mode()` keep no version counter, so an in-place edit of
    one could not be seen: their facts are computed on every call."""
    if torch.compiler.is_compiling() or t.is_inference():
        return compute(t)
    key = (id(t), what)
    hit = _MEMO.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    value = compute(t)
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        # Kernels captured into a CUDA graph run only when it replays: a device result made
        # now holds nothing yet, so it serves this call (the capture) and is not remembered.
        return value
    ref = weakref.ref(t, lambda _, key=key: _MEMO.pop(key, None))
    _MEMO[key] = (ref, t._version, value)
    return value
