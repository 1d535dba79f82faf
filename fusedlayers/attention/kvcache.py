"""`flash_attn_with_kvcache`: flash-attn 2.8's decoding entry, on the split-KV decode kernel.

Shapes (h = query heads, hk = KV heads, h % hk == 0):
    q        [b, s_q, h, d]           s_q new queries per sequence (1 for plain decoding)
    k_cache  [b_cache, s_cache, hk, d]                        contiguous cache, or
             [num_blocks, page_size, hk, d] + block_table [b, max_blocks] int32   paged cache
    v_cache  the shape of k_cache (d_v == d)
    k, v     [b, s_new, hk, d] (optional): appended in place at rows cache_seqlens[z] ..
    -> out [b, s_q, h, d] (q's dtype); with return_softmax_lse also lse fp32 [b, h, s_q]

Per sequence z (cache entry cache_batch_idx[z], default z), the keys are cache rows
[cache_leftpad[z], cache_seqlens[z] + s_new) after the append; query i sits at position
cache_seqlens[z] + s_new - s_q + i, so `causal=True` is bottom-right aligned (query i sees keys
j <= i + s_k - s_q, s_k = cache_seqlens + s_new), and `window_size=(left, right)` keeps keys in
[i + s_k - s_q - left, i + s_k - s_q + right]. Paged: logical row j of sequence z lives at row
j % page_size of page block_table[z, j // page_size]; page_size must be a multiple of 16.

Rotary (rotary_cos/sin [seqlen_ro, rotary_dim / 2], needs k and v): the new keys are rotated at
positions cache_seqlens + 0, 1, ..; the queries at the same positions when causal or windowed,
otherwise every query at position cache_seqlens. `rotary_interleaved=True` pairs channels
(0, 1), (2, 3), ..; False pairs (j, j + rotary_dim / 2) (GPT-NeoX). Channels past rotary_dim
pass through.

Everything is checked before the cache is touched: shapes, dtypes, devices, integer dtypes, the
page size, and (one read of device values per call, none when cache_seqlens is an int and no
other index tensor is given) cache_seqlens within the cache, appends that fit, cache_leftpad in
[0, cache_seqlens], cache_batch_idx in [0, b_cache), every block_table entry a sequence uses in
[0, num_blocks), and a rotary table long enough. A failed check raises before any write.
The checks that read only the call's signature (each tensor operand's shape, strides, dtype and
device, and the options) run once per signature: a repeat of a call that passed them skips them
(`_CHECKED`), and any change to a shape, a stride, a dtype or an option checks in full again.
Under CUDA graph capture nothing can be read back: the device-value checks are skipped (validate
the step eagerly first), and the rest of the call (rotary, append, attention) holds no host
sync, so a whole decode step captures and replays with new values in cache_seqlens. Under
torch.compile they are skipped too (a traced graph cannot branch on device values); the append
and the attention are custom ops there (`fusedlayers.kernels.decode_ops`), so a compiled model
with a static cache (transformers' `generate`) calls the same kernels.

The kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (like the functional
API). No backward.
"""

from __future__ import annotations

import torch

from .._backend import choose_backend
from .._logging import debug_enabled, log_decision
from ..errors import ArgumentError, ArgumentTypeError
from . import masks
from .validation import (
    KERNEL_DTYPES,
    MAX_KERNEL_HEAD_DIM,
    check_head_counts,
    check_softcap,
    check_softmax_scale,
    host_values,
)

try:
    from ..kernels import check_page_size, decode_attention, rotate_and_append
    from ..kernels._common import remember
    from ..kernels._launch import call_signature, tensor_signature
except ImportError:  # Triton missing: `choose_backend` raises first with the reason
    decode_attention = rotate_and_append = check_page_size = None
    call_signature = tensor_signature = None

Tensor = torch.Tensor


def _describe(t: Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_tensor(t, name: str, rank: int, ref: Tensor, dtype=None) -> None:
    """`t` is a tensor of `rank` dims on ref's device with `dtype` (default: ref's)."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ArgumentError(f"{name} must be {rank}-D, got {_describe(t)}")
    want = ref.dtype if dtype is None else dtype
    if t.dtype != want:
        raise ArgumentTypeError(f"{name} must have dtype {want}, got {_describe(t)}")
    if t.device != ref.device:
        raise ArgumentError(f"{name} is on {t.device} but q is on {ref.device}")


def _check_index(t, name: str, b: int, q: Tensor) -> None:
    """An int32 [b] index tensor on q's device (or None)."""
    if t is None:
        return
    _check_tensor(t, name, 1, q, torch.int32)
    if t.shape[0] != b:
        raise ArgumentError(f"{name} must have shape [batch] = [{b}], got {_describe(t)}")


def _check_shapes(q, k_cache, v_cache, k, v, block_table, cache_batch_idx) -> None:
    """Ranks, dtypes, devices, head counts and dims of every tensor operand (q a 4-D tensor,
    checked before the backend choice reads its device)."""
    if q.dtype not in KERNEL_DTYPES:
        raise ArgumentTypeError(f"q dtype {q.dtype} is not supported (use one of {KERNEL_DTYPES})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(t, name, 4, q)
        if t.stride(-1) != 1:
            raise ArgumentError(f"{name} must have a contiguous last dim (it is updated in place)")
    if v_cache.shape != k_cache.shape:
        raise ArgumentError(
            f"v_cache {tuple(v_cache.shape)} must have the shape of k_cache {tuple(k_cache.shape)}"
        )
    b, _, h, d = q.shape
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ArgumentError(f"q head dim ({d}) differs from k_cache head dim ({k_cache.shape[3]})")
    if d > MAX_KERNEL_HEAD_DIM:
        raise ArgumentError(f"head dim {d} exceeds the kernels' maximum {MAX_KERNEL_HEAD_DIM}")
    check_head_counts(h, hk, "q/k_cache: ")
    if (k is None) != (v is None):
        raise ArgumentError("k and v must be given together (or neither)")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _check_tensor(t, name, 4, q)
            if t.shape[0] != b or t.shape[2:] != (hk, d):
                raise ArgumentError(
                    f"{name} must have shape [b, s_new, h_k, d] = [{b}, s_new, {hk}, {d}], got "
                    f"{_describe(t)}"
                )
        if v.shape != k.shape:
            raise ArgumentError(f"v {tuple(v.shape)} must have the shape of k {tuple(k.shape)}")
    if block_table is not None:
        _check_tensor(block_table, "block_table", 2, q, torch.int32)
        if block_table.shape[0] != b:
            raise ArgumentError(
                f"block_table must have shape [b, max_blocks], got {_describe(block_table)}"
            )
        if cache_batch_idx is not None:
            raise ArgumentError(
                "cache_batch_idx cannot be combined with a paged cache (block_table)"
            )
        check_page_size(k_cache.shape[1])
    elif cache_batch_idx is None and k_cache.shape[0] != b:
        raise ArgumentError(
            f"k_cache batch ({k_cache.shape[0]}) differs from q batch ({b}); pass "
            "cache_batch_idx to pick cache entries"
        )


def _check_rotary(rotary_cos, rotary_sin, q, k) -> None:
    if (rotary_cos is None) != (rotary_sin is None):
        raise ArgumentError("rotary_cos and rotary_sin must be given together (or neither)")
    if rotary_cos is None:
        return
    if k is None:
        raise ArgumentError("rotary_cos/rotary_sin need the new k and v (rotary applies on append)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ArgumentError(f"{name} must be a float tensor [seqlen_ro, rotary_dim / 2]")
        if t.device != q.device:
            raise ArgumentError(f"{name} is on {t.device} but q is on {q.device}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ArgumentError(
            f"rotary_sin {tuple(rotary_sin.shape)} must match rotary_cos {tuple(rotary_cos.shape)}"
        )
    rot_dim = 2 * rotary_cos.shape[1]
    if rot_dim == 0 or rot_dim > q.shape[-1]:
        raise ArgumentError(f"rotary_dim ({rot_dim} = 2 * rotary_cos.shape[1]) must be in [2, d]")


def _rotary_tables(rotary_cos, rotary_sin, interleaved: bool):
    """fp32 cos/sin tables [seqlen_ro, rotary_dim] in the rope kernel's per-channel form (of
    tables `_check_rotary` passed)."""
    if rotary_cos is None:
        return None
    # Each channel gets its own angle: pairs share one (interleaved (2j, 2j+1), else (j, j + r/2)).
    if interleaved:
        widen = lambda t: t.float().repeat_interleave(2, dim=-1)
    else:
        widen = lambda t: torch.cat((t.float(), t.float()), dim=-1)
    return widen(rotary_cos), widen(rotary_sin)


def _capacity(capacity: int, block_table: Tensor | None) -> str:
    """The cache capacity in an error message; a paged cache's is what `block_table` addresses
    (flash-attn names `block_table` in this error too)."""
    if block_table is None:
        return f"the cache capacity {capacity}"
    pages = block_table.shape[1]
    return (
        f"the capacity block_table addresses, {capacity} ({pages} pages per sequence x "
        f"page_size {capacity // max(pages, 1)})"
    )


def _seqlens(
    cache_seqlens, b: int, capacity: int, q: Tensor, checked: bool, block_table: Tensor | None
) -> tuple[Tensor, int | None]:
    """(int32 [b] device tensor, the host value when cache_seqlens is an int or None). An int
    is checked against the capacity every call; a tensor's dtype and shape unless `checked`."""
    if cache_seqlens is None:
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            raise ArgumentError(
                f"cache_seqlens={cache_seqlens} must be in [0, {capacity}], "
                f"{_capacity(capacity, block_table)}"
            )
        return torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device), cache_seqlens
    if not checked:
        _check_index(cache_seqlens, "cache_seqlens", b, q)
    return cache_seqlens, None


def _check_alibi(alibi_slopes, b: int, h: int) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise ArgumentTypeError(f"alibi_slopes must be a tensor, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32 or alibi_slopes.shape not in ((h,), (b, h)):
        raise ArgumentError(f"alibi_slopes must be fp32 [h] or [b, h], got {alibi_slopes.shape}")


# Calls whose signature-only checks passed (module docstring), with the mask spec they made.
_CHECKED: dict[tuple, masks.MaskSpec] = {}
_MAX_CHECKED = 256


def _call_signature(tensors: tuple, cache_seqlens, options: tuple) -> tuple | None:
    """What the signature-only checks read: each tensor operand's shape, strides, dtype and
    device (`tensor_signature`; None for an absent one), cache_seqlens' kind (an int's value is
    checked every call) and the options. None where a call cannot be keyed: an operand that is
    no tensor (the checks say so) or has no data pointer, an unhashable option, Triton missing,
    or torch.compile tracing."""
    if call_signature is None or torch.compiler.is_compiling():
        return None
    try:
        if isinstance(cache_seqlens, torch.Tensor):
            lengths = tensor_signature(cache_seqlens)
        else:
            lengths = type(cache_seqlens)
        key = call_signature(tensors, (lengths, *options))
        hash(key)
    except (AttributeError, TypeError, RuntimeError):  # e.g. a subclass without data_ptr()
        return None
    return key


def _check_device_values(
    seqlens, host_len, s_new, capacity, cache_leftpad, cache_batch_idx, b_cache, block_table,
    num_blocks, page_size, rotary,
) -> None:  # fmt: skip
    """The checks that need device values. Without `cache_leftpad` and `block_table` each fact
    is one tensor's (`host_values`: read once per tensor and in-place version, so the layers of a
    decode step that share `cache_seqlens` read it once; PyTorch's version counter is what marks
    an edit); with them, the facts that combine tensors are reduced on the device and read back
    once per call."""
    if seqlens.numel() == 0:  # an empty batch: nothing to check, nothing to write
        return
    if host_len is not None and host_len + s_new > capacity:
        raise ArgumentError(
            f"appending {s_new} rows at cache_seqlens={host_len} overflows "
            f"{_capacity(capacity, block_table)}"
        )
    if cache_leftpad is None and block_table is None:
        got = _facts_per_tensor(seqlens, host_len, s_new, cache_batch_idx)
    else:
        got = _facts_on_device(
            seqlens, host_len, s_new, cache_leftpad, cache_batch_idx, block_table, page_size
        )
    _check_facts(got, host_len, s_new, capacity, b_cache, num_blocks, rotary, block_table)


def _facts_per_tensor(seqlens, host_len, s_new, cache_batch_idx) -> dict[str, int]:
    got = {}
    if host_len is None:
        lengths = host_values(seqlens)
        got["seq_min"], got["end_max"] = min(lengths), max(lengths) + s_new
    if cache_batch_idx is not None:
        entries = host_values(cache_batch_idx)
        got["idx_min"], got["idx_max"] = min(entries), max(entries)
    return got


def _facts_on_device(
    seqlens, host_len, s_new, cache_leftpad, cache_batch_idx, block_table, page_size
) -> dict[str, int]:
    names, values = [], []
    if host_len is None:
        seq = seqlens.long()
        names += ["seq_min", "end_max"]
        values += [seq.min(), (seq + s_new).max()]
    else:
        seq = None
    if cache_leftpad is not None:
        pad = cache_leftpad.long()
        names += ["pad_min", "pad_excess"]
        values += [pad.min(), (pad - (seq if seq is not None else host_len)).max()]
    if cache_batch_idx is not None:
        names += ["idx_min", "idx_max"]
        values += [cache_batch_idx.min().long(), cache_batch_idx.max().long()]
    if block_table is not None and block_table.numel():
        ends = (seq if seq is not None else seqlens.long()) + s_new
        used = torch.arange(block_table.shape[1], device=ends.device) < (
            (ends[:, None] + page_size - 1) // page_size
        )
        table = block_table.long()
        names += ["page_min", "page_max"]
        values += [torch.where(used, table, 0).min(), torch.where(used, table, 0).max()]
    if not values:
        return {}
    return dict(zip(names, torch.stack(values).tolist()))  # the one host read


def _check_facts(
    got, host_len, s_new, capacity, b_cache, num_blocks, rotary, block_table
) -> None:  # fmt: skip
    if "seq_min" in got:
        if got["seq_min"] < 0:
            raise ArgumentError(f"cache_seqlens must be >= 0, got minimum {got['seq_min']}")
        if got["end_max"] > capacity:
            what = f"cache_seqlens + s_new (s_new = {s_new})" if s_new else "cache_seqlens"
            raise ArgumentError(
                f"{what} reaches {got['end_max']}, beyond {_capacity(capacity, block_table)}"
                + (" (an append that overflows the cache)" if s_new else "")
            )
    if "pad_min" in got and (got["pad_min"] < 0 or got["pad_excess"] > 0):
        raise ArgumentError(
            f"cache_leftpad must be in [0, cache_seqlens] per sequence, got minimum "
            f"{got['pad_min']} and a pad {got['pad_excess']} past its sequence's length"
        )
    if "idx_min" in got and (got["idx_min"] < 0 or got["idx_max"] >= b_cache):
        raise ArgumentError(
            f"cache_batch_idx must be in [0, {b_cache}) (k_cache.shape[0]), got values in "
            f"[{got['idx_min']}, {got['idx_max']}]"
        )
    if "page_min" in got and (got["page_min"] < 0 or got["page_max"] >= num_blocks):
        raise ArgumentError(
            f"block_table points outside [0, {num_blocks}) (num_blocks = k_cache.shape[0]): "
            f"entries in use range over [{got['page_min']}, {got['page_max']}]"
        )
    if rotary is not None:  # (table positions, rows rotated from cache_seqlens on)
        seqlen_ro, span = rotary
        last = (got["end_max"] - s_new if host_len is None else host_len) + span - 1
        if last >= seqlen_ro:
            raise ArgumentError(
                f"rotary_cos/rotary_sin have {seqlen_ro} positions, but position {last} is needed"
                f" (rows rotated from cache_seqlens on: {span})"
            )


def append_to_cache(k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table) -> None:
    """Write k/v [b, s_new, hk, d] at logical rows seqlens[z] + 0.. of each sequence, in place,
    with one indexed write per cache (no loop over the batch)."""
    b, s_new = k.shape[:2]
    rows = seqlens.long()[:, None] + torch.arange(s_new, device=k.device)  # [b, s_new]
    if block_table is not None:
        page_size = k_cache.shape[1]
        first = block_table.long().gather(1, rows // page_size)
        second = rows % page_size
    else:
        entry = torch.arange(b, device=k.device) if cache_batch_idx is None else cache_batch_idx
        first, second = entry.long()[:, None].expand(b, s_new), rows
    k_cache[first, second] = k
    v_cache[first, second] = v


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Append k/v to the cache in place (if given), then attend q to the updated cache.

    See the module docstring for shapes and semantics. Returns out `[b, s_q, h, d]`, or
    `(out, softmax_lse)` with `return_softmax_lse=True` (lse fp32 `[b, h, s_q]`, natural log).
    `num_splits`: 0 = heuristic, 1 = one program per key range (no combine), n = n splits.
    """
    key = _call_signature(
        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
         block_table, alibi_slopes),
        cache_seqlens,
        (softmax_scale, causal, window_size, softcap, num_splits),
    )  # fmt: skip
    spec = _CHECKED.get(key) if key is not None else None
    checked = spec is not None
    if not checked:
        _check_tensor(q, "q", 4, q)  # before the backend choice reads q's device
    choose_backend("kernel", q, "q")  # CUDA tensors, or CPU ones under the interpreter
    if not checked:
        _check_shapes(q, k_cache, v_cache, k, v, block_table, cache_batch_idx)
    b, s_q, h, d = q.shape
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    s_new = 0 if k is None else k.shape[1]
    seqlens, host_len = _seqlens(cache_seqlens, b, capacity, q, checked, block_table)
    if not checked:
        _check_index(cache_batch_idx, "cache_batch_idx", b, q)
        _check_index(cache_leftpad, "cache_leftpad", b, q)
        spec = masks.flash_attn_spec(causal, window_size)
        _check_rotary(rotary_cos, rotary_sin, q, k)
        _check_alibi(alibi_slopes, b, h)
        check_softcap(softcap)
        check_softmax_scale(softmax_scale)
        if int(num_splits) < 0:
            raise ArgumentError(f"num_splits={num_splits} must be >= 0 (0 = heuristic)")
        if key is not None:
            remember(_CHECKED, key, spec, _MAX_CHECKED)
    tables = _rotary_tables(rotary_cos, rotary_sin, rotary_interleaved)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(q.device).expand(b, h)
    # Rows rotated from cache_seqlens on: the new keys, and the queries too when causal or
    # windowed (query i at cache_seqlens + i).
    local = causal or tuple(window_size) != (-1, -1)
    rotary = None if tables is None else (tables[0].shape[0], max(s_new, s_q) if local else s_new)
    # Values on the device are read on the host only in eager calls: a CUDA graph capture
    # cannot sync, and torch.compile cannot trace a branch on them. There the caller vouches
    # for them, as flash-attn's callers always do (it checks none of them).
    # Compiling is asked first: Dynamo cannot trace the capture query and would break the graph.
    compiling = torch.compiler.is_compiling()
    if not (compiling or (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        _check_device_values(
            seqlens, host_len, s_new, capacity, cache_leftpad, cache_batch_idx, k_cache.shape[0],
            block_table, k_cache.shape[0], page_size,
            rotary,
        )  # fmt: skip

    if debug_enabled():
        layout = f"paged, page_size {page_size}" if paged else "contiguous"
        log_decision(
            "flash_attn_with_kvcache",
            f"split-KV decode kernel: {layout} cache of capacity {capacity}, s_q {s_q}, "
            f"{h // k_cache.shape[2]} query heads per KV head, append {s_new} rows, rotary "
            f"{'on' if tables is not None else 'off'}, num_splits {num_splits} (0 = heuristic)",
        )

    out, lse = cache_attention(
        q,
        k_cache,
        v_cache,
        seqlens,
        k=k,
        v=v,
        rotary_q=tables,
        rotary_k=tables,
        rotary_local=local,
        rotary_interleaved=rotary_interleaved,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        softmax_scale=d**-0.5 if softmax_scale is None else float(softmax_scale),
        window_size=spec.window_size,
        softcap=float(softcap),
        alibi_slopes=alibi_slopes,
        num_splits=int(num_splits),
        return_lse=return_softmax_lse,
        # The check key covers every tensor and option the kernel entry's arguments come from
        # (each derived the same way on every call of the key), so it serves as the entry's
        # launch signature and the entry skips keying its arguments again.
        signature=None if key is None else ("flash_attn_with_kvcache", key),
    )
    return (out, lse) if return_softmax_lse else out


def cache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seqlens: Tensor,
    *,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_q: tuple[Tensor, Tensor] | None = None,
    rotary_k: tuple[Tensor, Tensor] | None = None,
    rotary_local: bool = True,
    rotary_interleaved: bool = False,
    block_table: Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = True,
    signature: tuple | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Rotate, append and attend on validated input: `flash_attn_with_kvcache` after its checks,
    shared with the decode path of the layers (`fusedlayers.layers.cached_attention`).

    `seqlens` int32 [b] (on q's device): rows cached per sequence before the append. `rotary_q`
    / `rotary_k`: fp32 (cos, sin) tables [n_pos, rotary_dim] with one angle per channel (the
    rope kernel's form), applied when k is given (`kernels/_cache_append.py` says at which
    positions). `window_size` is bottom-right aligned, causal = (-1, 0). Returns
    (out [b, s_q, h, d], lse fp32 [b, h, s_q]); lse is None with `return_lse=False` (the kernel
    then writes it to scratch and allocates only out). `signature`: the caller's key of these
    arguments, handed to `decode_attention` (see there). Everything stays on the device (no host
    read), so a caller can capture it in a CUDA graph.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k is not None:
        # Rotation and the cache writes in one launch, lengths advanced on the device.
        k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
        q, seqlens = rotate_and_append(
            q, k, v, k_cache, v_cache, seqlens,
            rotary_q=rotary_q if rotary_k is not None else None, rotary_k=rotary_k,
            local=rotary_local, interleaved=rotary_interleaved,
            block_table=block_table, cache_batch_idx=cache_batch_idx,
        )  # fmt: skip
    return decode_attention(
        q,
        k_cache,
        v_cache,
        seqlens if seqlens.dtype == torch.int32 else seqlens.to(torch.int32),
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        softmax_scale=softmax_scale,
        window_left=window_size[0],
        window_right=window_size[1],
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        num_splits=num_splits,
        return_lse=return_lse,
        signature=signature,
    )


__all__ = ["append_to_cache", "cache_attention", "flash_attn_with_kvcache"]
