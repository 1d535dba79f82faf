"""Context parallelism: ring attention over a process group (TransformerEngine's `p2p` type).

Each rank of `cp_group` holds a slice of every sequence. Queries stay put; K/V blocks travel
around the ring (rank r sends to r + 1 and receives from r - 1, posted before the step's compute
so the transfer overlaps it), and each rank merges the partial outputs by their log-sum-exp. The
forward keeps the K/V blocks it received; the backward computes the other ranks' blocks first
and sends each one's dK/dV partial straight to its owner, then its own block, which covers the
transfers (`ring_attention`).

Load balancing for causal masks (TE's): the sequence is cut into `2 * cp` chunks of `c` tokens and
rank r holds chunks r and 2cp-1-r, in that order (`context_parallel_indices`). At ring step i,
rank r holds the K/V of rank src = (r - i) mod cp, and the causal mask reduces to one of three
blocks, none of which needs a general mask:

    i == 0     its own chunks: causal attention on the local sequence
    src < r    all local queries see the first K/V chunk (src) in full, none of the second
    src > r    only the second query chunk (2cp-1-r) sees anything, and it sees all of K/V

The ring itself (blocks, merge, the autograd Function) is `ring_attention`; this module checks
the call, before any compute, and sets the ring up.

Shapes (dense = sbhd/bshd, read as bshd views; thd per sequence, 2c_z tokens on each rank):
    dense  q [b, 2c, h, d_qk], k [b, 2c, hg, d_qk], v [b, 2c, hg, d_v] -> out [b, 2c, h, d_v]
    thd    q [t/cp, h, d_qk],  k [t/cp, hg, d_qk],  v [t/cp, hg, d_v]  -> out [t/cp, h, d_v]
    lse    dense [b, h, 2c], thd [h, t/cp], fp32
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._backend import choose_backend
from ..errors import ArgumentError, ArgumentTypeError
from . import masks, validation
from .ring_attention import Ring, RingAttention

CP_COMM_TYPES = ("p2p",)
_DENSE_MASKS = ("no_mask", "causal", "causal_bottom_right")
_THD_MASKS = _DENSE_MASKS + ("padding", "padding_causal", "padding_causal_bottom_right")


def check_cp_arguments(cp_group, cp_global_ranks, cp_stream, cp_comm_type) -> list[int] | None:
    """Validate TE's context-parallel arguments; returns the group's global ranks (None when
    `cp_group` is None). Raises naming the argument and its value."""
    if cp_comm_type not in CP_COMM_TYPES:
        raise ArgumentError(
            f"cp_comm_type={cp_comm_type!r} is not supported; context parallelism runs the ring "
            f"exchange, one of {CP_COMM_TYPES}"
        )
    if cp_group is None:
        if cp_global_ranks is not None:
            raise ArgumentError(f"cp_global_ranks={cp_global_ranks} is given without a cp_group")
        return None
    if isinstance(cp_group, (list, tuple)):
        raise ArgumentError(
            f"cp_group={cp_group!r}: a list of groups is TE's 'a2a+p2p' form; pass one group"
        )
    if not dist.is_initialized():
        raise RuntimeError("cp_group is given but torch.distributed is not initialized")
    ranks = dist.get_process_group_ranks(cp_group)
    if cp_global_ranks is not None and list(cp_global_ranks) != list(ranks):
        raise ArgumentError(
            f"cp_global_ranks={list(cp_global_ranks)} does not match cp_group's ranks {ranks}"
        )
    if cp_stream is not None and not isinstance(cp_stream, torch.cuda.Stream):
        raise ArgumentTypeError(f"cp_stream must be a torch.cuda.Stream or None, got {cp_stream!r}")
    return ranks


def context_parallel_indices(
    seqlens: list[int], cp_size: int, cp_rank: int, device=None
) -> torch.Tensor:
    """Rows of the full sequences that rank `cp_rank` holds, in its order (int64).

    `seqlens` are the full lengths of the sequences stored back to back (one entry for a dense
    sequence dim, one per sequence for thd); each is cut into 2*cp chunks and the rank takes
    chunks `cp_rank` and `2*cp - 1 - cp_rank` of every sequence. Within a sequence, an index
    minus the sequence start is the token's global position (what RoPE needs).
    """
    rows, start = [], 0
    for length in seqlens:
        if length % (2 * cp_size):
            raise ArgumentError(
                f"sequence length {length} is not divisible by 2 * cp_size = {2 * cp_size}"
            )
        c = length // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            rows.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
        start += length
    return torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long, device=device)


def context_parallel_positions(
    s_local: int, cp_size: int, cp_rank: int, device=None
) -> torch.Tensor:
    """Global positions `[s_local]` of a rank's tokens of one sequence (TE's load balancing)."""
    if cp_size == 1:
        return torch.arange(s_local, device=device)
    return context_parallel_indices([s_local * cp_size], cp_size, cp_rank, device)


def _check_features(
    qkv_format,
    attn_mask_type,
    window_size,
    attention_mask,
    bias_type,
    bias,
    alibi_slopes,
    dropout_p,
) -> bool:
    """What the ring supports, checked before any compute; returns whether the mask is causal."""
    allowed = _THD_MASKS if qkv_format == "thd" else _DENSE_MASKS
    if attn_mask_type not in allowed:
        raise ArgumentError(
            f"attn_mask_type={attn_mask_type!r} is not supported with context parallelism "
            f"(cp_group given) and qkv_format={qkv_format!r}; use one of {allowed}"
        )
    causal = "causal" in attn_mask_type
    window = masks.normalize_window_size(attn_mask_type, window_size)
    if window != ((-1, 0) if causal else (-1, -1)):
        raise ArgumentError(
            f"window_size={tuple(window_size)} is not supported with context parallelism: the "
            "ring's load-balanced chunks take full causal or unmasked attention only"
        )
    unsupported = dict(
        attention_mask=attention_mask,
        core_attention_bias=bias,
        alibi_slopes=alibi_slopes,
    )
    for name, value in unsupported.items():
        if value is not None:
            raise ArgumentError(
                f"{name} is not supported with context parallelism (cp_group given)"
            )
    if bias_type != "no_bias":
        raise ArgumentError(
            f"core_attention_bias_type={bias_type!r} is not supported with context parallelism"
        )
    if dropout_p > 0:
        raise ArgumentError(
            f"attention_dropout={dropout_p} is not supported with context parallelism; set it to 0"
        )
    return causal


def _dense_geometry(q, k, causal, cp_size, qkv_format) -> None:
    s_dim = 0 if qkv_format == "sbhd" else 1
    s_q, s_kv = q.shape[s_dim], k.shape[s_dim]
    if causal and (s_q != s_kv or s_q % 2):
        raise ArgumentError(
            f"causal context parallelism needs equal query and key lengths, each 2 chunks of the "
            f"sequence cut into 2 * cp_size = {2 * cp_size}: got local query_layer length {s_q} "
            f"and key_layer length {s_kv} (full lengths {s_q * cp_size}, {s_kv * cp_size})"
        )


def _thd_geometry(q, k, cu_q, cu_kv, cu_q_pad, cu_kv_pad, causal, cp_size) -> dict:
    """Local cu_seqlens and half-sequence row indices from the full sequences' `cu_seqlens`."""
    if cu_q is None:
        raise ArgumentError("qkv_format='thd' needs cu_seqlens_q (of the full sequences)")
    cu_kv = cu_q if cu_kv is None else cu_kv
    seqs = {}
    for name, cu, pad, t in (
        ("cu_seqlens_q", cu_q, cu_q_pad, q),
        ("cu_seqlens_kv", cu_kv, cu_kv_pad, k),
    ):
        tokens = t.shape[0] * cp_size
        if (
            isinstance(cu, torch.Tensor)
            and cu.dim() == 1
            and cu.numel()
            and not cu.is_floating_point()
        ):
            last = validation.host_values(cu)[-1]
            if last != tokens:
                raise ArgumentError(
                    f"{name} ends at {last}, but with context parallelism it describes the full "
                    f"sequences: {t.shape[0]} tokens on this rank x cp_size {cp_size} = {tokens}"
                )
        values = validation.check_cu_seqlens(cu, name, tokens)
        if pad is not None and validation.host_values(pad) != values:
            raise ArgumentError(
                f"{name}_padded={validation.host_values(pad)[:16]} differs from {name}: padding "
                "between sequences is not supported with context parallelism"
            )
        lengths = [b - a for a, b in zip(values, values[1:])]
        bad = [n for n in lengths if n % (2 * cp_size)]
        if bad:
            raise ArgumentError(
                f"{name}={values[:16]}: every sequence length must be divisible by 2 * cp_size "
                f"= {2 * cp_size}, got {bad[:8]}"
            )
        seqs[name] = values
    if causal and seqs["cu_seqlens_q"] != seqs["cu_seqlens_kv"]:
        raise ArgumentError("causal context parallelism needs cu_seqlens_kv equal to cu_seqlens_q")
    device = q.device

    def local(values, parts):
        cu = torch.tensor([x // parts for x in values], dtype=torch.int32, device=device)
        return cu, max((b - a for a, b in zip(values, values[1:])), default=0) // parts

    geometry = {}
    geometry["cu_q"], geometry["max_q"] = local(seqs["cu_seqlens_q"], cp_size)
    geometry["cu_kv"], geometry["max_kv"] = local(seqs["cu_seqlens_kv"], cp_size)
    geometry["cu_half"], geometry["max_half"] = local(seqs["cu_seqlens_q"], 2 * cp_size)
    # Each sequence holds its two chunks back to back: the first c_z rows, then the next c_z.
    halves = geometry["cu_half"].tolist()
    starts = [2 * a for a in halves]
    first = [torch.arange(s, s + b - a) for s, a, b in zip(starts, halves, halves[1:])]
    second = [
        torch.arange(s + b - a, s + 2 * (b - a)) for s, a, b in zip(starts, halves, halves[1:])
    ]
    empty = torch.zeros(0, dtype=torch.long)
    geometry["first"] = torch.cat(first or [empty]).to(device)
    geometry["second"] = torch.cat(second or [empty]).to(device)
    return geometry


def _use_kernel(backend: str, q: torch.Tensor, v: torch.Tensor) -> bool:
    """`choose_backend`'s rule: the kernels for CUDA tensors they take (`auto`), always
    (`kernel`: `check_qkv` then names what they cannot take), never (`reference`)."""
    blocker = "" if backend == "kernel" else validation.kernel_blocker(q, v)
    return choose_backend(backend, q, "query_layer", blocker)[0]


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group,
    cp_global_ranks: list[int] | None = None,
    cp_stream: torch.cuda.Stream | None = None,
    qkv_format: str = "bshd",
    attn_mask_type: str = "causal",
    window_size: tuple[int, int] | None = None,
    attention_mask=None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    softmax_scale: float | None = None,
    core_attention_bias_type: str = "no_bias",
    core_attention_bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    backend: str = "auto",
    expected_heads: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of this rank's slice of every sequence over all of them; out `[..., h, d_v]`.

    q, k, v hold this rank's tokens in `qkv_format` (sbhd/bshd: chunks r and 2cp-1-r of the
    sequence dim, see `context_parallel_indices`; thd: those chunks of every sequence, back to
    back). For thd, `cu_seqlens_*` and `max_seqlen_*` describe the full sequences, as in TE.
    `max_seqlen_*` are accepted and not needed (the host knows the lengths). The other arguments
    are `DotProductAttention`'s; those the ring cannot serve raise before any compute.
    """
    del max_seqlen_q, max_seqlen_kv  # derived from cu_seqlens, which the host reads anyway
    ranks = check_cp_arguments(cp_group, cp_global_ranks, cp_stream, "p2p")
    use_kernel = _use_kernel(backend, q, v)
    validation.check_qkv(q, k, v, qkv_format, use_kernel)
    if expected_heads is not None:
        validation.check_configured_heads(q, k, v, expected_heads)
    causal = _check_features(
        qkv_format,
        attn_mask_type,
        window_size,
        attention_mask,
        core_attention_bias_type,
        core_attention_bias,
        alibi_slopes,
        dropout_p,
    )
    size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    varlen = {}
    if qkv_format == "thd":
        varlen = _thd_geometry(
            q,
            k,
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_q_padded,
            cu_seqlens_kv_padded,
            causal,
            size,
        )
    else:
        _dense_geometry(q, k, causal, size, qkv_format)
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            if cu is not None:
                raise ArgumentError(
                    f"{name} with qkv_format={qkv_format!r} is not supported with context "
                    "parallelism (padding); use qkv_format='thd'"
                )
    ring = Ring(
        group=cp_group,
        rank=rank,
        size=size,
        ranks=ranks,
        causal=causal,
        scale=q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale),
        use_kernel=use_kernel,
        deterministic=deterministic,
        stream=cp_stream if (q.is_cuda and size > 1) else None,
        varlen=varlen,
    )
    views = [t.transpose(0, 1) if qkv_format == "sbhd" else t for t in (q, k, v)]
    # The kernels read any strides but need the head dim contiguous.
    views = [t if t.stride(-1) == 1 else t.contiguous() for t in views]
    out = RingAttention.apply(*views, ring)
    return out.transpose(0, 1) if qkv_format == "sbhd" else out
