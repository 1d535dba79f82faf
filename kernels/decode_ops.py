"""The decode entries `decode_attention` and `rotate_and_append`, opaque to torch.compile.

In eager mode each entry calls its launcher directly (`_flash_decode.py`, `_cache_append.py`).
Under torch.compile it calls a torch.library custom op instead, `fusedlayers::decode_attention`
or `fusedlayers::rotate_and_append`, so that Dynamo and Inductor see one node with a fake
implementation and never trace the launchers. Tracing them fails: their scratch buffers and
per-device counters are module state that a compiled, CUDA-graphed region would own and
overwrite, and Inductor recompiles a user-defined autotuned kernel in its own way. transformers'
static-cache `generate` compiles the model with its attention, so it takes this route.

Shapes are the launchers' (see there). Inside a custom op, `decode_attention` always computes lse
(an op's outputs are fixed); the entry drops it with `return_lse=False`. The append op mutates
the caches in place, and returns a new rotated q (a copy without rotary: an op's output may not
alias its input).
"""

from __future__ import annotations

import torch

from ._cache_append import rotate_and_append as _rotate_and_append_launch
from ._flash_decode import decode_attention as _decode_attention_launch

Tensor = torch.Tensor


@torch.library.custom_op("fusedlayers::decode_attention", mutates_args=())
def _decode_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens_k: Tensor,
    block_table: Tensor | None,
    cache_batch_idx: Tensor | None,
    cache_leftpad: Tensor | None,
    alibi_slopes: Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
) -> tuple[Tensor, Tensor]:
    return _decode_attention_launch(
        q, k_cache, v_cache, seqlens_k, block_table=block_table, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, softmax_scale=softmax_scale, window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
        num_splits=num_splits, return_lse=True, shared_buffers=False,
    )  # fmt: skip


@_decode_op.register_fake
def _(q, k_cache, v_cache, seqlens_k, *args) -> tuple[Tensor, Tensor]:
    b, s_q, h_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h_q, s_q), dtype=torch.float32)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens_k: Tensor,
    *,
    block_table: Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = True,
    signature: tuple | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`_flash_decode.decode_attention` (arguments and shapes there); under torch.compile, the
    custom op around it (`signature`, a host-side key, is then not used)."""
    if torch.compiler.is_compiling():
        out, lse = _decode_op(
            q, k_cache, v_cache, seqlens_k, block_table, cache_batch_idx, cache_leftpad,
            alibi_slopes, float(softmax_scale), int(window_left), int(window_right),
            float(softcap), int(num_splits),
        )  # fmt: skip
        return out, lse if return_lse else None
    return _decode_attention_launch(
        q, k_cache, v_cache, seqlens_k, block_table=block_table, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, softmax_scale=softmax_scale, window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=alibi_slopes,
        num_splits=num_splits, return_lse=return_lse, signature=signature,
    )  # fmt: skip


@torch.library.custom_op("fusedlayers::rotate_and_append", mutates_args=("k_cache", "v_cache"))
def _append_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens: Tensor,
    q_cos: Tensor | None,
    q_sin: Tensor | None,
    k_cos: Tensor | None,
    k_sin: Tensor | None,
    local: bool,
    interleaved: bool,
    block_table: Tensor | None,
    cache_batch_idx: Tensor | None,
) -> tuple[Tensor, Tensor]:
    q_out, seqlens_out = _rotate_and_append_launch(
        q, k, v, k_cache, v_cache, seqlens,
        rotary_q=None if q_cos is None else (q_cos, q_sin),
        rotary_k=None if k_cos is None else (k_cos, k_sin),
        local=local, interleaved=interleaved, block_table=block_table,
        cache_batch_idx=cache_batch_idx,
    )  # fmt: skip
    return (q_out.clone() if q_out is q else q_out), seqlens_out


@_append_op.register_fake
def _(q, k, v, k_cache, v_cache, seqlens, *args) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), seqlens.new_empty(seqlens.shape, dtype=torch.int32)


def rotate_and_append(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens: Tensor,
    *,
    rotary_q: tuple[Tensor, Tensor] | None,
    rotary_k: tuple[Tensor, Tensor] | None,
    local: bool,
    interleaved: bool,
    block_table: Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`_cache_append.rotate_and_append` (arguments and shapes there); under torch.compile, the
    custom op around it."""
    if torch.compiler.is_compiling():
        q_cos, q_sin = rotary_q if rotary_q is not None else (None, None)
        k_cos, k_sin = rotary_k if rotary_k is not None else (None, None)
        return _append_op(
            q, k, v, k_cache, v_cache, seqlens, q_cos, q_sin, k_cos, k_sin, bool(local),
            bool(interleaved), block_table, cache_batch_idx,
        )  # fmt: skip
    return _rotate_and_append_launch(
        q, k, v, k_cache, v_cache, seqlens, rotary_q=rotary_q, rotary_k=rotary_k, local=local,
        interleaved=interleaved, block_table=block_table, cache_batch_idx=cache_batch_idx,
    )  # fmt: skip
