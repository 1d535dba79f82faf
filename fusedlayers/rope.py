"""Rotary position embedding (RoPE) with TransformerEngine's interface.

`RotaryPositionEmbedding(dim)(max_seq_len)` returns the angle table `freqs [max_seq_len, 1, 1,
d_rot]` (fp32); `apply_rotary_pos_emb(t, freqs, tensor_format)` rotates the first `d_rot` channels
of every head of `t` and passes the rest through (partial rotation, `rotary_percent < 1`).

Shapes of `t` per `tensor_format`: `sbhd [s, b, h, d]`, `bshd [b, s, h, d]`, `thd [t, h, d]`
(then `cu_seqlens` int32 `[b+1]` says where each sequence starts, and positions restart at 0 for
every sequence). Token at position `p` of sequence `i` uses row `p + start_positions[i]` of
`freqs` (`start_positions` int `[b]`, default 0): decoding passes the number of cached tokens.

Channel pairing: rotate-half (default) pairs channel `j` with `j + d_rot/2` and the table holds
`[f_0 .. f_{n-1}, f_0 .. f_{n-1}]`; interleaved pairs `2j` with `2j+1` and the table holds
`[f_0, f_0, f_1, f_1, ...]`. Output has `t`'s shape and dtype; the rotation runs in fp32.
"""

from __future__ import annotations

import torch

from .validation import host_values

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


def token_positions(
    t: torch.Tensor,
    tensor_format: str,
    cu_seqlens: torch.Tensor | None = None,
    start_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position of every token: `sbhd [s, b]`, `bshd [b, s]`, `thd [t]` (int64)."""
    device = t.device
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("tensor_format 'thd' needs cu_seqlens")
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        rows = torch.arange(t.shape[0], device=device)
        # Sequence of each row; rows past the last sequence (padding) go to the last one.
        seq = (torch.searchsorted(cu, rows, right=True) - 1).clamp(0, cu.numel() - 2)
        positions = rows - cu[seq]
        if start_positions is not None:
            positions = positions + start_positions.to(device=device, dtype=torch.int64)[seq]
        return positions
    if tensor_format not in FORMATS:
        raise ValueError(f"tensor_format ({tensor_format!r}) must be one of {FORMATS}")
    s_dim, b_dim = (0, 1) if tensor_format == "sbhd" else (1, 0)
    s, b = t.shape[s_dim], t.shape[b_dim]
    positions = torch.arange(s, device=device).unsqueeze(1).expand(s, b)
    if start_positions is not None:
        positions = positions + start_positions.to(device=device, dtype=torch.int64).view(1, b)
    return positions if tensor_format == "sbhd" else positions.t()


def _largest_position(
    t: torch.Tensor,
    tensor_format: str,
    cu_seqlens: torch.Tensor | None,
    start_positions: torch.Tensor | None,
) -> int:
    """The largest position `token_positions` gives `t`, computed on the host: `cu_seqlens` and
    `start_positions` are read once per tensor version (`host_values`), where reducing the
    device positions would sync on every call. -1 when there are no tokens."""

    def on_host(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.tensor(host_values(x))

    shape_only = torch.empty((*t.shape[:-2], 0))  # token_positions reads t's leading dims only
    positions = token_positions(
        shape_only, tensor_format, on_host(cu_seqlens), on_host(start_positions)
    )
    return int(positions.max()) if positions.numel() else -1


def _check_table_covers(freqs: torch.Tensor, last: int) -> None:
    if last >= freqs.shape[0]:
        raise ValueError(f"RoPE table has {freqs.shape[0]} positions, position {last} requested")


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
) -> torch.Tensor:
    """Rotate `t` (`sbhd [s, b, h, d]`, `bshd [b, s, h, d]`, `thd [t, h, d]`) by `freqs [s_max, 1,
    1, d_rot]` (`d_rot <= d`, `s_max` covering every position used); see the module docstring.

    `fused` is accepted for TE compatibility (one implementation serves both). Context parallelism
    is not supported (`cp_size` must be 1).
    """
    del fused  # one implementation; TE's flag only picks its CUDA kernel
    if cp_size != 1 or cp_rank != 0:
        raise NotImplementedError("apply_rotary_pos_emb: context parallelism is not supported")
    d_rot = freqs.shape[-1]
    if d_rot > t.shape[-1] or d_rot % 2:
        raise ValueError(f"rotary dim ({d_rot}) must be even and at most head dim ({t.shape[-1]})")
    compute = torch.float64 if torch.float64 in (t.dtype, freqs.dtype) else torch.float32
    table = freqs.reshape(freqs.shape[0], d_rot).to(compute)
    if start_positions is None and tensor_format in ("sbhd", "bshd"):
        # Dense, every sequence from position 0: the positions are 0..s-1, known from the shape.
        # Slicing the table instead of gathering it per token reads nothing back from the device
        # (a sync per call, which left the GPU idle between kernels in training) and computes
        # cos/sin once per position instead of once per token.
        s = t.shape[0 if tensor_format == "sbhd" else 1]
        _check_table_covers(freqs, s - 1)
        angles = table[:s].view((s, 1, 1, d_rot) if tensor_format == "sbhd" else (1, s, 1, d_rot))
    else:
        positions = token_positions(t, tensor_format, cu_seqlens, start_positions)
        _check_table_covers(freqs, _largest_position(t, tensor_format, cu_seqlens, start_positions))
        angles = table[positions].unsqueeze(-2)
    rot, rest = t[..., :d_rot].to(compute), t[..., d_rot:]
    rotated = rot * torch.cos(angles) + _rotate(rot, interleaved) * torch.sin(angles)
    return torch.cat((rotated.to(t.dtype), rest), dim=-1)


__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]
