"""Rotary position embedding (RoPE) with TransformerEngine's interface.

`RotaryPositionEmbedding(dim)(max_seq_len)` returns the angle table `freqs [max_seq_len, 1, 1,
d_rot]` (fp32); `apply_rotary_pos_emb(t, freqs, tensor_format)` rotates the first `d_rot` channels
of every head of `t` and passes the rest through (partial rotation, `rotary_percent < 1`).

Shapes of `t` per `tensor_format`: `sbhd [s, b, h, d]`, `bshd [b, s, h, d]`, `thd [t, h, d]`
(then `cu_seqlens` int32 `[b+1]` says where each sequence starts, and positions restart at 0 for
every sequence). Token at position `p` of sequence `i` uses row `p + start_positions[i]` of
`freqs` (`start_positions` int `[b]`, default 0): decoding passes the number of cached tokens.
With context parallelism (`cp_size > 1`, TE's semantics) `t` holds rank `cp_rank`'s chunks
`cp_rank` and `2*cp_size-1-cp_rank` of every sequence cut into `2*cp_size`, each token keeps its
global position, and thd's `cu_seqlens` describe the full sequences.

Channel pairing: rotate-half (default) pairs channel `j` with `j + d_rot/2` and the table holds
`[f_0 .. f_{n-1}, f_0 .. f_{n-1}]`; interleaved pairs `2j` with `2j+1` and the table holds
`[f_0, f_0, f_1, f_1, ...]`. Output has `t`'s shape and dtype; the rotation runs in fp32.

Two paths behind `apply_rotary_pos_emb`, chosen by `backend`:
- kernel: the fused Triton kernel of `fusedlayers.kernels.rope`, one read of t and one write of
  the output per direction, strided views (q/k sliced from a fused QKV projection) read in place.
  torch computes the fp32 cos/sin tables from `freqs` once per table (`rope_tables`, remembered
  until `freqs` is edited in place or freed). `auto` takes it for CUDA tensors of fp16/bf16/fp32.
  `rotate_qk` (what MultiheadAttention calls for self-attention) rotates q and k with one launch
  per pass and one autograd node where both take the kernel.
- reference: the PyTorch code below (fp32, fp64 for fp64 inputs): the `use_reference=True` path
  and the tests' oracle. CPU tensors, fp64 and a `freqs` that requires grad (the kernel has no
  gradient for the table) take it under `auto`.
"""

from __future__ import annotations

import torch

from .._backend import choose_backend
from .._host_cache import per_version
from .._logging import debug_enabled, log_decision
from ..attention.validation import host_values

try:
    from ..kernels import ROPE_DTYPES, rope, rope_pair
except ImportError as error:  # Triton missing (no Linux wheel) or broken: the reference serves
    rope = rope_pair = None
    ROPE_DTYPES, _KERNELS_MISSING = (), f"kernels unavailable ({error})"
else:
    _KERNELS_MISSING = None

FORMATS = ("sbhd", "bshd", "thd")


class RotaryPositionEmbedding(torch.nn.Module):
    """TE's `RotaryPositionEmbedding(dim, rotary_percent, seq_len_interpolation_factor,
    pretrained_max_position_embeddings, rotary_base, interleaved)`.

    Angles: `f_j(p) = p / rotary_base ** (2j / d_rot)`, `d_rot = int(dim * rotary_percent)`.
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: float | None = None,
        pretrained_max_position_embeddings: int | None = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.rotary_base = rotary_base
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.interleaved = interleaved
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / rotary_base**exponents)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Angle table for positions `offset .. offset + max_seq_len - 1`: `[max_seq_len, 1, 1,
        d_rot]`, fp32."""
        positions = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32)
        positions = positions + offset
        factor = self.seq_len_interpolation_factor
        if factor is not None:
            pretrained = self.pretrained_max_position_embeddings
            # Position interpolation: squeeze positions into the trained range; beyond the
            # trained range times the factor, squeeze dynamically by the actual length.
            if pretrained is not None and max_seq_len > pretrained * factor:
                positions = positions * (pretrained / max_seq_len)
            else:
                positions = positions / factor
        angles = torch.outer(positions, self.inv_freq)
        if self.interleaved:
            table = angles.repeat_interleave(2, dim=-1)
        else:
            table = torch.cat((angles, angles), dim=-1)
        return table.view(max_seq_len, 1, 1, -1)


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of each channel with the sign of the rotation: `(-x2, x1)` per pair."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _global_positions(local: torch.Tensor, length: torch.Tensor | int, cp: tuple[int, int]):
    """Context parallelism: local offsets within a rank's `length` tokens of one sequence (its
    chunks cp_rank and 2cp-1-cp_rank, each length/2 long) -> positions in the full sequence."""
    cp_size, cp_rank = cp
    if cp_size == 1:
        return local
    chunk = length // 2
    second = local >= chunk
    first_start, second_start = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.where(second, second_start + local - chunk, first_start + local)


def token_positions(
    t: torch.Tensor,
    tensor_format: str,
    cu_seqlens: torch.Tensor | None = None,
    start_positions: torch.Tensor | None = None,
    cp: tuple[int, int] = (1, 0),
) -> torch.Tensor:
    """Position of every token: `sbhd [s, b]`, `bshd [b, s]`, `thd [t]` (int64); `cp` is
    (cp_size, cp_rank) under context parallelism (thd `cu_seqlens` then count full sequences)."""
    device = t.device
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("tensor_format 'thd' needs cu_seqlens")
        cu = cu_seqlens.to(device=device, dtype=torch.int64) // cp[0]  # this rank's rows
        rows = torch.arange(t.shape[0], device=device)
        # Sequence of each row; rows past the last sequence (padding) go to the last one.
        seq = (torch.searchsorted(cu, rows, right=True) - 1).clamp(0, cu.numel() - 2)
        positions = _global_positions(rows - cu[seq], cu[seq + 1] - cu[seq], cp)
        if start_positions is not None:
            positions = positions + start_positions.to(device=device, dtype=torch.int64)[seq]
        return positions
    if tensor_format not in FORMATS:
        raise ValueError(f"tensor_format ({tensor_format!r}) must be one of {FORMATS}")
    s_dim, b_dim = (0, 1) if tensor_format == "sbhd" else (1, 0)
    s, b = t.shape[s_dim], t.shape[b_dim]
    positions = _global_positions(torch.arange(s, device=device), s, cp).unsqueeze(1).expand(s, b)
    if start_positions is not None:
        positions = positions + start_positions.to(device=device, dtype=torch.int64).view(1, b)
    return positions if tensor_format == "sbhd" else positions.t()


def _largest_position(
    t: torch.Tensor,
    tensor_format: str,
    cu_seqlens: torch.Tensor | None,
    start_positions: torch.Tensor | None,
    cp: tuple[int, int] = (1, 0),
) -> int:
    """The largest position `token_positions` gives `t`, computed on the host: `cu_seqlens` and
    `start_positions` are read once per tensor version (`host_values`), where reducing the
    device positions would sync on every call. -1 when there are no tokens."""

    def on_host(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.tensor(host_values(x))

    shape_only = torch.empty((*t.shape[:-2], 0))  # token_positions reads t's leading dims only
    positions = token_positions(
        shape_only, tensor_format, on_host(cu_seqlens), on_host(start_positions), cp
    )
    return int(positions.max()) if positions.numel() else -1


def _check_table_covers(freqs: torch.Tensor, last: int) -> None:
    if last >= freqs.shape[0]:
        raise ValueError(f"RoPE table has {freqs.shape[0]} positions, position {last} requested")


def _check_format(tensor_format: str) -> None:
    if tensor_format not in FORMATS:
        raise ValueError(f"tensor_format ({tensor_format!r}) must be one of {FORMATS}")


def _check_table_bound(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str,
    cu_seqlens: torch.Tensor | None,
    start_positions: torch.Tensor | None,
    cp: tuple[int, int] = (1, 0),
) -> None:
    """Every position a token uses must be a row of `freqs`; checked on the host."""
    if start_positions is None and tensor_format != "thd":
        # Dense from position 0: the largest position is s * cp_size - 1, known from the shape.
        _check_table_covers(freqs, t.shape[_seq_dim(tensor_format)] * cp[0] - 1)
    else:
        last = _largest_position(t, tensor_format, cu_seqlens, start_positions, cp)
        _check_table_covers(freqs, last)


def _seq_dim(tensor_format: str) -> int:
    """The dim of t that indexes positions within a sequence (thd: the token dim)."""
    return 1 if tensor_format == "bshd" else 0


def _kernel_blocker(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str) -> str:
    """Why the Triton kernel cannot take this call ("" when it can), naming argument and value."""
    if _KERNELS_MISSING is not None:
        return _KERNELS_MISSING
    if t.dtype not in ROPE_DTYPES:
        return f"t dtype ({t.dtype}) is not one the RoPE kernel takes {ROPE_DTYPES}"
    if freqs.dtype == torch.float64:
        return "freqs dtype (torch.float64): the reference computes in fp64, the kernel in fp32"
    if freqs.requires_grad and torch.is_grad_enabled():
        return "freqs requires grad: the kernel has no gradient for the angle table"
    if freqs.device != t.device:
        return f"freqs is on {freqs.device} but t is on {t.device}"
    rank = 3 if tensor_format == "thd" else 4
    if t.dim() != rank:
        return (
            f"t has {t.dim()} dims ({tuple(t.shape)}), tensor_format {tensor_format!r} has {rank}"
        )
    return ""


def _use_kernel(
    backend: str, t: torch.Tensor, freqs: torch.Tensor, tensor_format: str
) -> tuple[bool, str]:
    """(run the kernel?, why): `choose_backend` for the RoPE kernel."""
    return choose_backend(backend, t, "t", _kernel_blocker(t, freqs, tensor_format))


def _cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
    return angles.cos(), angles.sin()


def rope_tables(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [n_pos, d_rot] of a TE angle table [n_pos, 1, 1, d_rot], computed once
    per table and in-place version: a model that builds its table once per step pays for cos and
    sin once, not per layer and tensor (two launches each on the host-bound small-batch step),
    and a captured decode step holds no table kernels."""
    return per_version(freqs, "rope_cos_sin", _cos_sin)


def _kernel_arguments(t, freqs, tensor_format, start_positions, cu_seqlens, cp):
    """(cos, sin, positions, seq_dim) for the kernels: the table's fp32 cos/sin
    (`rope_tables`) and, unless the positions are the sequence index, every token's position."""
    cos, sin = rope_tables(freqs)
    if start_positions is None and tensor_format != "thd" and cp[0] == 1:
        # Dense from 0: the kernel takes each token's position from its index, so there is no
        # positions tensor.
        positions = None
    else:
        positions = token_positions(t, tensor_format, cu_seqlens, start_positions, cp)
    return cos, sin, positions, _seq_dim(tensor_format)


def _rope_kernel(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str,
    start_positions: torch.Tensor | None,
    interleaved: bool,
    cu_seqlens: torch.Tensor | None,
    cp: tuple[int, int] = (1, 0),
) -> torch.Tensor:
    """The fused kernel on validated input."""
    cos, sin, positions, seq_dim = _kernel_arguments(
        t, freqs, tensor_format, start_positions, cu_seqlens, cp
    )
    return rope(t, cos, sin, positions, seq_dim=seq_dim, interleaved=interleaved)


def _rope_reference(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str,
    start_positions: torch.Tensor | None,
    interleaved: bool,
    cu_seqlens: torch.Tensor | None,
    cp: tuple[int, int] = (1, 0),
) -> torch.Tensor:
    """The PyTorch path, in fp32 (fp64 when t or freqs is fp64), on validated input."""
    d_rot = freqs.shape[-1]
    compute = torch.float64 if torch.float64 in (t.dtype, freqs.dtype) else torch.float32
    table = freqs.reshape(freqs.shape[0], d_rot).to(compute)
    if start_positions is None and tensor_format in ("sbhd", "bshd") and cp[0] == 1:
        # Dense, every sequence from position 0: the positions are 0..s-1, known from the shape.
        # Slicing the table instead of gathering it per token reads nothing back from the device
        # (a sync per call, which left the GPU idle between kernels in training) and computes
        # cos/sin once per position instead of once per token.
        s = t.shape[_seq_dim(tensor_format)]
        angles = table[:s].view((s, 1, 1, d_rot) if tensor_format == "sbhd" else (1, s, 1, d_rot))
    else:
        positions = token_positions(t, tensor_format, cu_seqlens, start_positions, cp)
        angles = table[positions].unsqueeze(-2)
    rot, rest = t[..., :d_rot].to(compute), t[..., d_rot:]
    rotated = rot * torch.cos(angles) + _rotate(rot, interleaved) * torch.sin(angles)
    return torch.cat((rotated.to(t.dtype), rest), dim=-1)


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Rotate `t` (`sbhd [s, b, h, d]`, `bshd [b, s, h, d]`, `thd [t, h, d]`) by `freqs [s_max, 1,
    1, d_rot]` (`d_rot <= d`, `s_max` covering every position used); see the module docstring.
    Returns a tensor of t's shape and dtype (contiguous on the kernel path).

    backend: `auto` runs the fused Triton kernel on CUDA tensors of fp16/bf16/fp32 and the
    PyTorch reference otherwise (CPU tensors, fp64, a `freqs` that requires grad); `kernel`
    insists (ValueError naming what it cannot take; CPU tensors need `TRITON_INTERPRET=1`);
    `reference` is the PyTorch path. MultiheadAttention passes `reference` when its
    `use_reference` switch is on, else `auto`.

    `fused` is accepted for TE compatibility and ignored: in TE it picks TE's CUDA kernel over its
    PyTorch code; here `backend` picks the path, and `auto` fuses on CUDA whatever `fused` says.
    `cp_size`, `cp_rank`: context parallelism (module docstring): `freqs` covers the full
    sequences, `t` holds this rank's chunks, thd `cu_seqlens` describe the full sequences.
    """
    del fused  # TE's switch between its own two implementations; `backend` decides here
    cp = _check_call(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    use_kernel = _decide(backend, t, freqs, tensor_format)
    path = _rope_kernel if use_kernel else _rope_reference
    return path(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp)


def _check_call(t, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank):
    """Every check `apply_rotary_pos_emb` makes before either path runs; returns (cp_size,
    cp_rank)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank ({cp_rank}) must be in [0, cp_size ({cp_size}))")
    cp = (int(cp_size), int(cp_rank))
    d_rot = freqs.shape[-1]
    if d_rot > t.shape[-1] or d_rot % 2:
        raise ValueError(f"rotary dim ({d_rot}) must be even and at most head dim ({t.shape[-1]})")
    _check_format(tensor_format)
    _check_table_bound(t, freqs, tensor_format, cu_seqlens, start_positions, cp)
    return cp


def _decide(backend: str, t: torch.Tensor, freqs: torch.Tensor, tensor_format: str) -> bool:
    """Whether t takes the kernel (`_use_kernel`), logged when debugging."""
    use_kernel, why = _use_kernel(backend, t, freqs, tensor_format)
    if debug_enabled():
        log_decision("RoPE", ("kernel: " if use_kernel else "reference: ") + why)
    return use_kernel


def rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary_pos_emb` of q and of k with one table and the same positions: the
    self-attention case, q `[..., h, d]` and k `[..., g, d]` with the same leading dims (shapes
    as `apply_rotary_pos_emb`'s t). Same checks and results; where both take the kernel they
    share one launch per pass and one autograd node (`kernels.rope_pair`), a Function and a
    launch less of host time per layer and pass."""
    cp = _check_call(q, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    shared = q.shape[:-2] == k.shape[:-2] and q.dtype == k.dtype and q.shape[-1] == k.shape[-1]
    if not shared:  # with q's tokens and head dim, k passes every check q passed
        _check_call(k, freqs, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank)
    q_kernel = _decide(backend, q, freqs, tensor_format)
    k_kernel = _decide(backend, k, freqs, tensor_format)
    if not (q_kernel and k_kernel and shared):
        rotated = []
        for t, use_kernel in ((q, q_kernel), (k, k_kernel)):
            path = _rope_kernel if use_kernel else _rope_reference
            rotated.append(
                path(t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp)
            )
        return rotated[0], rotated[1]
    cos, sin, positions, seq_dim = _kernel_arguments(
        q, freqs, tensor_format, start_positions, cu_seqlens, cp
    )
    return rope_pair(q, k, cos, sin, positions, seq_dim=seq_dim, interleaved=interleaved)


__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]
