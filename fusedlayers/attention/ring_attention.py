"""The ring of context parallelism: K/V blocks travel, outputs merge by their LSE.

`RingAttention` is the autograd Function behind `context_parallel.context_parallel_attention`,
which validates the call and builds the `Ring`. At ring step i rank r holds the K/V of rank
(r - i) mod cp; under a causal mask with TE's load balancing every step is one of three blocks
(`Ring.block`), computed by the kernels' forward (with LSE) and backward (from out, dout and
LSE), or by the reference path. Shapes: module docstring of `context_parallel`.

The forward keeps the K/V blocks it received, (cp - 1) times the local K/V (with GQA a fraction
of q's size), so the backward sends no K/V: it computes the other ranks' blocks first and sends
each block's dK/dV partial straight to its owner, where the transfers overlap the rank's own
block, the largest under a causal mask, which comes last. Partial results meet in the input
dtype where two terms meet (one rounding, bitwise what an fp32 sum rounded once gives), in fp32
where more do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .reference import attention_reference

try:
    from ..kernels import flash_attention
    from ..kernels.attention_ops import flash_attn_bwd
except ImportError:  # Triton missing: the ring runs on the reference path only
    flash_attention = flash_attn_bwd = None

KERNELS_AVAILABLE = flash_attention is not None


@dataclass
class Ring:
    """The group, this rank's place in it, and the options every step shares."""

    group: object
    rank: int
    size: int
    ranks: list[int]  # the group's global ranks, as torch.distributed's P2P ops take them
    causal: bool
    scale: float
    use_kernel: bool
    deterministic: bool
    stream: torch.cuda.Stream | None
    varlen: dict  # thd: cu_seqlens/max_seqlen of the full local sequences and of their halves

    def send_recv(self, send, to: int, recv, source: int, tag: int) -> list:
        """Post send -> rank `to` and recv <- rank `source` (group ranks); returns the requests
        to wait on. The forward's K/V (tag 0) and the backward's dK/dV (tag 1) never share a
        pair of ranks and a tag; gloo pairs messages by tag."""
        ops = [
            dist.P2POp(dist.isend, send, self.ranks[to], self.group, tag),
            dist.P2POp(dist.irecv, recv, self.ranks[source], self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)

    def block(self, step: int, rank: int | None = None) -> tuple[str, str, bool]:
        """(query rows, key rows, causal) that `rank` (default this one) computes at ring step
        `step`, holding the K/V of rank (rank - step) mod cp: rows are all/first/second."""
        rank = self.rank if rank is None else rank
        if not self.causal:
            return "all", "all", False
        if step == 0:
            return "all", "all", True
        src = (rank - step) % self.size
        return ("all", "first", False) if src < rank else ("second", "all", False)


def _seq_dim(ring: Ring, lse: bool) -> int:
    """The token dim: dense [b, s, h, d] 1, thd [t, h, d] 0; LSE dense [b, h, s] 2, thd [h, t] 1."""
    return (1 if ring.varlen else 2) if lse else (0 if ring.varlen else 1)


def _rows(t: torch.Tensor, which: str, ring: Ring, lse: bool = False) -> torch.Tensor:
    """The all/first/second-chunk rows of a local tensor (or LSE)."""
    if which == "all":
        return t
    dim = _seq_dim(ring, lse)
    if ring.varlen:
        return t.index_select(dim, ring.varlen[which])
    c = t.shape[dim] // 2
    return t.narrow(dim, 0 if which == "first" else c, c)


def _rows_shape(t: torch.Tensor, which: str, ring: Ring) -> torch.Size:
    """The shape of `_rows(t, which, ring)` (without gathering varlen rows)."""
    if which == "all":
        return t.shape
    dim, shape = _seq_dim(ring, False), list(t.shape)
    shape[dim] = ring.varlen[which].numel() if ring.varlen else t.shape[dim] // 2
    return torch.Size(shape)


def _put_rows(dst, which: str, src, ring: Ring, lse: bool = False, add: bool = False) -> None:
    """`dst[rows] = src` (or `+=`) for the rows `_rows` selects."""
    if which == "all":
        dst.add_(src) if add else dst.copy_(src)
    elif ring.varlen:
        index, dim = ring.varlen[which], _seq_dim(ring, lse)
        src = src.to(dst.dtype)
        dst.index_add_(dim, index, src) if add else dst.index_copy_(dim, index, src)
    else:
        view = _rows(dst, which, ring, lse)
        view.add_(src) if add else view.copy_(src)


def _lse_as_out(lse: torch.Tensor, ring: Ring) -> torch.Tensor:
    """LSE laid out to broadcast against out: [h, t] -> [t, h, 1]; [b, h, s] -> [b, s, h, 1]."""
    return (lse.t() if ring.varlen else lse.transpose(1, 2)).unsqueeze(-1)


def _varlen_args(ring: Ring, q_rows: str, k_rows: str) -> dict:
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
            cu_seqlens_q=cu.get("cu_seqlens_q"),
            cu_seqlens_k=cu.get("cu_seqlens_kv"),
            seq_offsets_q=None,
            seq_offsets_k=None,
            max_seqlen_q=cu.get("max_seqlen_q"),
            max_seqlen_k=cu.get("max_seqlen_kv"),
            seqlens_q=None,
            seqlens_k=None,
            softmax_scale=ring.scale,
            window_left=window[0],
            window_right=window[1],
            bottom_right=False,
            bias=None,
            bias_requires_grad=False,
            alibi_slopes=None,
            softcap=0.0,
            dropout_p=0.0,
            rng_state=None,
            deterministic=ring.deterministic,
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


def _merge(out, lse, out_b, lse_b, rows: str, ring: Ring) -> None:
    """Fold a block's (out_b, lse_b) into the running (out, lse) for `rows`, in place, in
    out's precision (fp32, fp64 for fp64 inputs): two passes over out's rows."""
    acc_out, acc_lse = _rows(out, rows, ring), _rows(lse, rows, ring, lse=True)
    new = torch.logaddexp(acc_lse, lse_b)
    # Rows no key has reached yet stay at -inf with weight 0 (exp(-inf - -inf) would be NaN).
    safe = torch.where(torch.isfinite(new), new, 0.0)
    w_acc, w_b = torch.exp(acc_lse - safe), torch.exp(lse_b - safe)
    acc_out.mul_(_lse_as_out(w_acc, ring)).addcmul_(out_b, _lse_as_out(w_b, ring))
    if ring.varlen and rows != "all":  # gathered rows are a copy: put them back
        _put_rows(out, rows, acc_out, ring)
        _put_rows(lse, rows, new, ring, lse=True)
    else:
        acc_lse.copy_(new)


def _sum_parts(own: torch.Tensor, parts: list, ring: Ring) -> torch.Tensor:
    """`own` (every row) plus each (rows, part), in own's dtype: in place where at most two
    terms meet per row (one rounding, as an fp32 sum rounded once), else summed in fp32."""
    if len(parts) > 1:
        acc = torch.float64 if own.dtype == torch.float64 else torch.float32
        total = own.to(acc)
    else:
        total = own
    for rows, part in parts:
        _put_rows(total, rows, part, ring, add=True)
    return total.to(own.dtype)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V in one flat buffer: one message per ring step."""
    return torch.cat((k.reshape(-1), v.reshape(-1)))


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    n = k_shape.numel()
    return buf[:n].view(k_shape), buf[n:].view(v_shape)


class RingAttention(torch.autograd.Function):
    """Ring attention forward and backward; `ring` carries the group and the options."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        kv, held, keep = (k, v), [], []
        buf = _pack(k, v) if ring.size > 1 else None
        out = lse = None
        for step in range(ring.size):
            pending = []
            if step + 1 < ring.size:
                recv = torch.empty_like(buf)
                pending = ring.send_recv(buf, (ring.rank + 1) % ring.size, recv,
                                         (ring.rank - 1) % ring.size, tag=0)  # fmt: skip
            q_rows, k_rows, causal = ring.block(step)
            k_b, v_b = (_rows(t, k_rows, ring) for t in kv)
            cu = _varlen_args(ring, q_rows, k_rows)
            out_b, lse_b = _block_forward(ring, _rows(q, q_rows, ring), k_b, v_b, causal, cu)
            if out is None:  # step 0, the rank's own block, covers every query row
                out, lse = out_b.to(acc), lse_b
            elif ring.stream is not None:
                # The merge of this step runs beside the next step's attention kernels; `keep`
                # holds its inputs until the end, so the allocator cannot hand their memory to
                # the main stream while the merge may still read it.
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
                held.append(buf)  # the backward computes this block again
                kv = _unpack(buf, k.shape, v.shape)
        if ring.stream is not None:
            torch.cuda.current_stream().wait_stream(ring.stream)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *held)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *held = ctx.saved_tensors
        ring: Ring = ctx.ring
        dout = dout.contiguous()
        blocks = [(k, v), *(_unpack(buf, k.shape, v.shape) for buf in held)]
        dq_parts, dkv_parts, requests = [], [], []
        # The other ranks' blocks first, each one's dK/dV sent to its owner at once; the rank
        # at step distance `step` ahead computes this rank's block at the same step and sends
        # its partial here. The own block (step 0) comes last, covering the transfers.
        for step in (*range(1, ring.size), 0):
            q_rows, k_rows, causal = ring.block(step)
            rows = lambda t, lse=False, w=q_rows: _rows(t, w, ring, lse)  # noqa: E731
            dq_b, dk_b, dv_b = _block_backward(
                ring,
                rows(q),
                *(_rows(t, k_rows, ring) for t in blocks[step]),
                rows(out),
                rows(dout),
                rows(lse, lse=True),
                causal,
                _varlen_args(ring, q_rows, k_rows),
            )
            if step == 0:
                dq_own, dk_own, dv_own = dq_b, dk_b, dv_b
                continue
            dq_parts.append((q_rows, dq_b))
            sender = (ring.rank + step) % ring.size
            their_rows = ring.block(step, sender)[1]
            shapes = _rows_shape(k, their_rows, ring), _rows_shape(v, their_rows, ring)
            recv = k.new_empty(shapes[0].numel() + shapes[1].numel())
            requests += ring.send_recv(
                _pack(dk_b, dv_b), (ring.rank - step) % ring.size, recv, sender, tag=1
            )
            dkv_parts.append((their_rows, recv, shapes))
        for request in requests:
            request.wait()
        dk_parts = [(r, _unpack(buf, *shapes)[0]) for r, buf, shapes in dkv_parts]
        dv_parts = [(r, _unpack(buf, *shapes)[1]) for r, buf, shapes in dkv_parts]
        dq = _sum_parts(dq_own, dq_parts, ring)
        return dq, _sum_parts(dk_own, dk_parts, ring), _sum_parts(dv_own, dv_parts, ring), None
