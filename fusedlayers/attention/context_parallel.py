"""Context parallelism: ring attention over a process group (TransformerEngine's `p2p` type).

Each rank of `cp_group` holds a slice of every sequence. Queries stay put; K/V blocks travel
around the ring (rank r sends to r + 1 and receives from r - 1, posted before the step's compute
so the transfer overlaps it), and each rank merges the partial outputs by their log-sum-exp. The
backward sends K/V around again, and the dK/dV of each block travels with it, accumulating every
rank's contribution, until one last hop hands it to its owner.

Load balancing for causal masks (TE's): the sequence is cut into `2 * cp` chunks of `c` tokens and
rank r holds chunks r and 2cp-1-r, in that order (`context_parallel_indices`). At ring step i,
rank r holds the K/V of rank src = (r - i) mod cp, and the causal mask reduces to one of three
blocks, none of which needs a general mask:

    i == 0     its own chunks: causal attention on the local sequence
    src < r    all local queries see the first K/V chunk (src) in full, none of the second
    src > r    only the second query chunk (2cp-1-r) sees anything, and it sees all of K/V

Shapes (dense = sbhd/bshd, read as bshd views; thd per sequence, 2c_z tokens on each rank):
    dense  q [b, 2c, h, d_qk], k [b, 2c, hg, d_qk], v [b, 2c, hg, d_v] -> out [b, 2c, h, d_v]
    thd    q [t/cp, h, d_qk],  k [t/cp, hg, d_qk],  v [t/cp, hg, d_v]  -> out [t/cp, h, d_v]
    lse    dense [b, h, 2c], thd [h, t/cp], fp32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import masks, validation
from .reference import attention_reference

try:
    from ..kernels import flash_attention
    from ..kernels.attention_ops import flash_attn_bwd
except ImportError:  # Triton missing: CP runs on the reference path only
    flash_attention = flash_attn_bwd = None

CP_COMM_TYPES = ("p2p",)
_DENSE_MASKS = ("no_mask", "causal", "causal_bottom_right")
_THD_MASKS = _DENSE_MASKS + ("padding", "padding_causal", "padding_causal_bottom_right")


def check_cp_arguments(cp_group, cp_global_ranks, cp_stream, cp_comm_type) -> list[int] | None:
    """Validate TE's context-parallel arguments; returns the group's global ranks (None when
    `cp_group` is None). Raises naming the argument and its value."""
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"cp_comm_type={cp_comm_type!r} is not supported; context parallelism runs the ring "
            f"exchange, one of {CP_COMM_TYPES}"
        )
    if cp_group is None:
        if cp_global_ranks is not None:
            raise ValueError(f"cp_global_ranks={cp_global_ranks} is given without a cp_group")
        return None
    if isinstance(cp_group, (list, tuple)):
        raise ValueError(
            f"cp_group={cp_group!r}: a list of groups is TE's 'a2a+p2p' form; pass one group"
        )
    if not dist.is_initialized():
        raise RuntimeError("cp_group is given but torch.distributed is not initialized")
    ranks = dist.get_process_group_ranks(cp_group)
    if cp_global_ranks is not None and list(cp_global_ranks) != list(ranks):
        raise ValueError(
            f"cp_global_ranks={list(cp_global_ranks)} does not match cp_group's ranks {ranks}"
        )
    if cp_stream is not None and not isinstance(cp_stream, torch.cuda.Stream):
        raise TypeError(f"cp_stream must be a torch.cuda.Stream or None, got {cp_stream!r}")
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
            raise ValueError(
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


@dataclass
class _Ring:
    """Neighbours on the ring and the options every step shares."""

    group: object
    rank: int
    size: int
    next_rank: int  # global ranks, as torch.distributed's P2P ops take them
    prev_rank: int
    causal: bool
    scale: float
    use_kernel: bool
    deterministic: bool
    stream: torch.cuda.Stream | None
    varlen: dict  # thd: cu_seqlens/max_seqlen of the full local sequences and of their halves

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> list:
        """Post send -> next and recv <- prev; returns the requests to wait on. K/V (tag 0)
        and dK/dV (tag 1) are in flight together in the backward; gloo pairs them by tag."""
        ops = [
            dist.P2POp(dist.isend, send, self.next_rank, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev_rank, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)

    def block(self, step: int) -> tuple[str, str, bool]:
        """(query rows, key rows, causal) of ring step `step`: rows are all/first/second."""
        if not self.causal:
            return "all", "all", False
        if step == 0:
            return "all", "all", True
        src = (self.rank - step) % self.size
        return ("all", "first", False) if src < self.rank else ("second", "all", False)


def _seq_dim(ring: _Ring, lse: bool) -> int:
    """The token dim: dense [b, s, h, d] 1, thd [t, h, d] 0; LSE dense [b, h, s] 2, thd [h, t] 1."""
    return (1 if ring.varlen else 2) if lse else (0 if ring.varlen else 1)


def _rows(t: torch.Tensor, which: str, ring: _Ring, lse: bool = False) -> torch.Tensor:
    """The all/first/second-chunk rows of a local tensor (or LSE)."""
    if which == "all":
        return t
    dim = _seq_dim(ring, lse)
    if ring.varlen:
        return t.index_select(dim, ring.varlen[which])
    c = t.shape[dim] // 2
    return t.narrow(dim, 0 if which == "first" else c, c)


def _put_rows(dst, which: str, src, ring: _Ring, lse: bool = False, add: bool = False) -> None:
    """`dst[rows] = src` (or `+=`) for the rows `_rows` selects."""
    if which == "all":
        dst.add_(src) if add else dst.copy_(src)
    elif ring.varlen:
        index, dim = ring.varlen[which], _seq_dim(ring, lse)
        dst.index_add_(dim, index, src) if add else dst.index_copy_(dim, index, src)
    else:
        view = _rows(dst, which, ring, lse)
        view.add_(src) if add else view.copy_(src)


def _lse_as_out(lse: torch.Tensor, ring: _Ring) -> torch.Tensor:
    """LSE laid out to broadcast against out: [h, t] -> [t, h, 1]; [b, h, s] -> [b, s, h, 1]."""
    return (lse.t() if ring.varlen else lse.transpose(1, 2)).unsqueeze(-1)


def _varlen_args(ring: _Ring, q_rows: str, k_rows: str) -> dict:
    if not ring.varlen:
        return {}
    q_key, k_key = ("half" if q_rows != "all" else "q"), ("half" if k_rows != "all" else "kv")
    return dict(
        cu_seqlens_q=ring.varlen[f"cu_{q_key}"],
        cu_seqlens_kv=ring.varlen[f"cu_{k_key}"],
        max_seqlen_q=ring.varlen[f"max_{q_key}"],
        max_seqlen_kv=ring.varlen[f"max_{k_key}"],
    )


def _block_forward(ring, q, k, v, causal, cu) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's (out, lse): the kernels or the reference, no mask or causal (s_q == s_k)."""
    window = (-1, 0) if causal else (-1, -1)
    if ring.use_kernel:
        return flash_attention(
            q,
            k,
            v,
            cu_seqlens_q=cu.get("cu_seqlens_q"),
            cu_seqlens_k=cu.get("cu_seqlens_kv"),
            max_seqlen_q=cu.get("max_seqlen_q"),
            max_seqlen_k=cu.get("max_seqlen_kv"),
            softmax_scale=ring.scale,
            window_size=window,
            bottom_right=False,
            deterministic=ring.deterministic,
        )
    return attention_reference(
        q,
        k,
        v,
        cu_seqlens_q=cu.get("cu_seqlens_q"),
        cu_seqlens_kv=cu.get("cu_seqlens_kv"),
        softmax_scale=ring.scale,
        window_size=window,
        bottom_right=False,
        return_lse=True,
    )


def _block_backward(ring, q, k, v, out, dout, lse, causal, cu):
    """One block's (dq, dk, dv) given the merged `out` and `lse` of its query rows.

    With the final out and LSE, a block's gradient is the flash backward of that block alone:
    P = exp(S - lse) is the block's share of the full softmax, and rowsum(dout * out) is the
    full row's term. The kernels take exactly that; the reference recomputes its block under
    autograd and back-propagates through the merge (d out_b = w dout, d lse_b = w (dout.out_b -
    dout.out), w = exp(lse_b - lse)), so the reference needs no backward of its own.
    """
    window = (-1, 0) if causal else (-1, -1)
    if ring.use_kernel:
        dq, dk, dv, _ = flash_attn_bwd(
            dout,
            q,
            k,
            v,
            out,
            lse.contiguous(),
            cu.get("cu_seqlens_q"),
            cu.get("cu_seqlens_kv"),
            None,
            None,
            cu.get("max_seqlen_q"),
            cu.get("max_seqlen_kv"),
            None,
            None,
            ring.scale,
            window[0],
            window[1],
            False,
            None,
            False,
            None,
            0.0,
            0.0,
            None,
            ring.deterministic,
        )
        return dq, dk, dv
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out_b, lse_b = _block_forward(ring, *leaves, causal, cu)
    finite = torch.isfinite(lse)
    w = torch.where(finite, torch.exp(lse_b.detach() - torch.where(finite, lse, 0.0)), 0.0)
    w_out = _lse_as_out(w, ring).to(out.dtype)
    row_dot = lambda a: (dout * a).sum(-1)  # noqa: E731  [b, s, h] / [t, h]
    term = row_dot(out_b.detach()) - row_dot(out)
    d_lse = w * (term.permute(1, 0) if ring.varlen else term.transpose(1, 2)).float()
    return torch.autograd.grad((out_b, lse_b), leaves, (dout * w_out, d_lse))


def _merge(out, lse, out_b, lse_b, rows: str, ring: _Ring) -> None:
    """Fold a block's (out_b, lse_b) into the running (out, lse) for `rows`, in place, fp32+."""
    acc_out, acc_lse = _rows(out, rows, ring), _rows(lse, rows, ring, lse=True)
    new = torch.logaddexp(acc_lse, lse_b)
    # Rows no key has reached yet stay at -inf with weight 0 (exp(-inf - -inf) would be NaN).
    safe = torch.where(torch.isfinite(new), new, 0.0)
    w_acc, w_b = torch.exp(acc_lse - safe), torch.exp(lse_b - safe)
    merged = acc_out * _lse_as_out(w_acc, ring) + out_b.to(out.dtype) * _lse_as_out(w_b, ring)
    _put_rows(out, rows, merged, ring)
    _put_rows(lse, rows, new, ring, lse=True)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in one flat buffer: one message per ring step."""
    return torch.cat((k.reshape(-1), v.reshape(-1)))


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return buf[:n].view(k_shape), buf[n:].view(v_shape)


class RingAttention(torch.autograd.Function):
    """Ring attention forward and backward; `ring` carries the group and the options."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=acc)
        lse_shape = (
            (q.shape[1], q.shape[0]) if ring.varlen else (q.shape[0], q.shape[2], q.shape[1])
        )
        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
        kv, keep = (k, v), []
        buf = _pack(k, v) if ring.size > 1 else None
        for step in range(ring.size):
            pending = []
            if step + 1 < ring.size:
                recv = torch.empty_like(buf)
                pending = ring.exchange(buf, recv)
            q_rows, k_rows, causal = ring.block(step)
            k_b, v_b = (_rows(t, k_rows, ring) for t in kv)
            cu = _varlen_args(ring, q_rows, k_rows)
            out_b, lse_b = _block_forward(ring, _rows(q, q_rows, ring), k_b, v_b, causal, cu)
            if ring.stream is not None:
                # The merge of this step runs beside the next step's attention kernels.
                keep.append((out_b, lse_b))
                ring.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(ring.stream):
                    _merge(out, lse, out_b, lse_b, q_rows, ring)
            else:
                _merge(out, lse, out_b, lse_b, q_rows, ring)
            for request in pending:
                request.wait()
            if pending:
                buf = recv
                kv = _unpack(buf, k.shape, v.shape)
        if ring.stream is not None:
            torch.cuda.current_stream().wait_stream(ring.stream)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        dout = dout.contiguous()
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, buf = (k, v), (_pack(k, v) if ring.size > 1 else None)
        dkv, dkv_pending, dkv_recv = None, [], None
        for step in range(ring.size):
            kv_pending = []
            if step + 1 < ring.size:
                recv = torch.empty_like(buf)
                kv_pending = ring.exchange(buf, recv)
            q_rows, k_rows, causal = ring.block(step)
            rows = lambda t, lse=False, w=q_rows: _rows(t, w, ring, lse)  # noqa: E731
            dq_b, dk_b, dv_b = _block_backward(
                ring,
                rows(q),
                *(_rows(t, k_rows, ring) for t in kv),
                rows(out),
                rows(dout),
                rows(lse, lse=True),
                causal,
                _varlen_args(ring, q_rows, k_rows),
            )
            _put_rows(dq, q_rows, dq_b.to(acc), ring, add=True)
            # The dK/dV of the block held now: what earlier ranks added, plus this rank's part.
            for request in dkv_pending:
                request.wait()
            dkv = (
                dkv_recv if dkv_recv is not None else k.new_zeros(k.numel() + v.numel(), dtype=acc)
            )
            dk_acc, dv_acc = _unpack(dkv, k.shape, v.shape)
            _put_rows(dk_acc, k_rows, dk_b.to(acc), ring, add=True)
            _put_rows(dv_acc, k_rows, dv_b.to(acc), ring, add=True)
            if ring.size > 1:  # pass it on; after the last step this hop reaches the owner
                dkv_recv = torch.empty_like(dkv)
                dkv_pending = ring.exchange(dkv, dkv_recv, tag=1)
            for request in kv_pending:
                request.wait()
            if kv_pending:
                buf = recv
                kv = _unpack(buf, k.shape, v.shape)
        for request in dkv_pending:
            request.wait()
        dk, dv = _unpack(dkv_recv if ring.size > 1 else dkv, k.shape, v.shape)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


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
        raise ValueError(
            f"attn_mask_type={attn_mask_type!r} is not supported with context parallelism "
            f"(cp_group given) and qkv_format={qkv_format!r}; use one of {allowed}"
        )
    causal = "causal" in attn_mask_type
    window = masks.normalize_window_size(attn_mask_type, window_size)
    if window != ((-1, 0) if causal else (-1, -1)):
        raise ValueError(
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
            raise ValueError(f"{name} is not supported with context parallelism (cp_group given)")
    if bias_type != "no_bias":
        raise ValueError(
            f"core_attention_bias_type={bias_type!r} is not supported with context parallelism"
        )
    if dropout_p > 0:
        raise ValueError(
            f"attention_dropout={dropout_p} is not supported with context parallelism; set it to 0"
        )
    return causal


def _dense_geometry(q, k, causal, cp_size, qkv_format) -> None:
    s_dim = 0 if qkv_format == "sbhd" else 1
    s_q, s_kv = q.shape[s_dim], k.shape[s_dim]
    if causal and (s_q != s_kv or s_q % 2):
        raise ValueError(
            f"causal context parallelism needs equal query and key lengths, each 2 chunks of the "
            f"sequence cut into 2 * cp_size = {2 * cp_size}: got local query_layer length {s_q} "
            f"and key_layer length {s_kv} (full lengths {s_q * cp_size}, {s_kv * cp_size})"
        )


def _thd_geometry(q, k, cu_q, cu_kv, cu_q_pad, cu_kv_pad, causal, cp_size) -> dict:
    """Local cu_seqlens and half-sequence row indices from the full sequences' `cu_seqlens`."""
    if cu_q is None:
        raise ValueError("qkv_format='thd' needs cu_seqlens_q (of the full sequences)")
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
                raise ValueError(
                    f"{name} ends at {last}, but with context parallelism it describes the full "
                    f"sequences: {t.shape[0]} tokens on this rank x cp_size {cp_size} = {tokens}"
                )
        values = validation.check_cu_seqlens(cu, name, tokens)
        if pad is not None and validation.host_values(pad) != values:
            raise ValueError(
                f"{name}_padded={validation.host_values(pad)[:16]} differs from {name}: padding "
                "between sequences is not supported with context parallelism"
            )
        lengths = [b - a for a, b in zip(values, values[1:])]
        bad = [n for n in lengths if n % (2 * cp_size)]
        if bad:
            raise ValueError(
                f"{name}={values[:16]}: every sequence length must be divisible by 2 * cp_size "
                f"= {2 * cp_size}, got {bad[:8]}"
            )
        seqs[name] = values
    if causal and seqs["cu_seqlens_q"] != seqs["cu_seqlens_kv"]:
        raise ValueError("causal context parallelism needs cu_seqlens_kv equal to cu_seqlens_q")
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
    """Kernels for CUDA tensors they take (`auto`), always (`kernel`), never (`reference`)."""
    if backend == "reference":
        return False
    if backend == "kernel":
        if flash_attention is None:
            raise RuntimeError("backend='kernel': the Triton kernels cannot be imported")
        return True
    return (
        flash_attention is not None
        and q.is_cuda
        and q.dtype in validation.KERNEL_DTYPES
        and max(q.shape[-1], v.shape[-1]) <= validation.MAX_KERNEL_HEAD_DIM
    )


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
                raise ValueError(
                    f"{name} with qkv_format={qkv_format!r} is not supported with context "
                    "parallelism (padding); use qkv_format='thd'"
                )
    ring = _Ring(
        group=cp_group,
        rank=rank,
        size=size,
        next_rank=ranks[(rank + 1) % size],
        prev_rank=ranks[(rank - 1) % size],
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
