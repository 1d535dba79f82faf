"""FP8 numerics in plain PyTorch: formats, scales from amaxes, casts, the delayed-scaling update.

Conventions (TransformerEngine's): a *scale* multiplies a high-precision tensor into FP8 range
(`fp8 = saturate(x * scale)`), its reciprocal *scale_inv* turns FP8 back (`x ~= fp8 * scale_inv`);
scales and amaxes are fp32. A `Quantized` tensor is the FP8 data with its scale_inv: one value for
per-tensor scaling, or one per block (`block = (rows, cols)`, 1x128 or 128x128) for block scaling.

Every function here runs on any device; the GEMM path (`gemm.py`) and the CPU tests share them,
so the emulation and the GPU path cast identically. On CUDA the per-tensor cast and amax run as
`torch.compile`d functions (`FUSED_CASTS`): in eager PyTorch a cast is five passes over the
tensor with fp32 intermediates (upcast, scale, clamp, convert; abs and max for the amax), the
likely reason (not profiled) FP8 ran GPT-1.3B at 0.66-0.68x bf16; compiled, each is one pass. The
compiled functions compute the same operations in the same order, so their results are bitwise
those of the eager ones (tests/test_fp8_scaling.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..recipe import DelayedScaling, Format, QParams
from ._torch_compat import E4M3, E5M2

FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Quantized:
    """FP8 `data [rows, cols]` (contiguous) and its fp32 `scale_inv`: 0-d for one scale per
    tensor, `[ceil(rows / block[0]), ceil(cols / block[1])]` for block scaling."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] | None = None


def fp8_dtype(fp8_format: Format, backward: bool) -> torch.dtype:
    """The torch dtype of a tensor in `fp8_format`: gradients (`backward`) are E5M2 under
    HYBRID, everything else E4M3 (E5M2 everywhere under Format.E5M2)."""
    if fp8_format is Format.E5M2 or (fp8_format is Format.HYBRID and backward):
        return E5M2
    return E4M3


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value: 448 for E4M3, 57344 for E5M2."""
    return float(torch.finfo(dtype).max)


# `FUSEDLAYERS_FP8_FUSED_CASTS=0` keeps the eager casts on CUDA too (A/B runs).
FUSED_CASTS = os.environ.get("FUSEDLAYERS_FP8_FUSED_CASTS", "1") not in ("", "0")


def _amax_eager(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax().float()


def _scaled_cast_eager(t: torch.Tensor, scale: torch.Tensor, limit: float, dtype: torch.dtype):
    # Saturate as TE's casts do: torch's cast sends out-of-range values to NaN (E4M3) or inf.
    return (t.float() * scale).clamp(-limit, limit).to(dtype)


_COMPILED: dict = {}


def _compiled(fn):
    """`fn` compiled for every shape (dynamic), made on first use: `torch.compile` imports
    TorchDynamo, a second of `import fusedlayers` that no CPU or bf16 run needs."""
    compiled = _COMPILED.get(fn)
    if compiled is None:
        compiled = _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
    return compiled


def _fused(t: torch.Tensor) -> bool:
    return FUSED_CASTS and t.is_cuda


_logger = logging.getLogger(__name__)
_warned_eager = False


def _run(fn, t: torch.Tensor, *args):
    """`fn(t.detach(), *args)`, compiled where `_fused(t)` (FP8 data and amaxes take no
    gradient). `detach()` also drops a view's link to its base: compiled, a view is guarded on
    its base's strides, so the layers' differently shaped bases
    each compiled again, and the ninth (TorchDynamo's recompile limit) failed a GPT-1.3B step.
    A call the compiler refuses all the same (more layouts and dtypes than that limit) runs
    eager, bitwise the same result, with one warning."""
    global _warned_eager
    t = t.detach()
    if not _fused(t):
        return fn(t, *args)
    try:
        return _compiled(fn)(t, *args)
    except Exception as error:  # noqa: BLE001 - eager is exact; an error of its own raises there
        if not _warned_eager:
            _warned_eager = True
            _logger.warning(
                "fusedlayers FP8: a compiled cast failed (%s); that call and any "
                "other the compiler refuses run eager",
                type(error).__name__,
            )
        return fn(t, *args)


def amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a 0-d fp32 tensor (0 for an empty tensor); NaN propagates."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return _run(_amax_eager, t)


def scale_from_amax(a: torch.Tensor, max_value: float, qparams: QParams | None = None):
    """Current scaling's rule, elementwise on fp32 amaxes: `max_value / max(amax, epsilon)`; 1
    where the amax is 0 or not finite; fp32's max where the quotient overflows; rounded down to
    a power of 2 with `qparams.power_2_scale`."""
    qparams = qparams or QParams()
    a = a.float()
    if qparams.amax_epsilon > 0:
        a = torch.clamp(a, min=qparams.amax_epsilon)
    scale = max_value / a
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    scale = torch.where((a == 0) | ~torch.isfinite(a), torch.ones_like(scale), scale)
    if qparams.power_2_scale:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> Quantized:
    """Per-tensor cast: `t [rows, cols]` times the 0-d fp32 `scale`, saturated, to `dtype`."""
    scale = scale.float()
    data = _run(_scaled_cast_eager, t, scale, fp8_max(dtype), dtype).contiguous()
    return Quantized(data, torch.reciprocal(scale))


def quantize_blocks(
    t: torch.Tensor, dtype: torch.dtype, block: tuple[int, int], qparams: QParams | None
) -> Quantized:
    """Block cast: one scale per `block` of `t [rows, cols]` from the block's amax
    (`scale_from_amax`); edge blocks are partial (padded with zeros for their amax only)."""
    rows, cols = t.shape
    br, bc = block
    pad_rows, pad_cols = -rows % br, -cols % bc
    padded = F.pad(t.float(), (0, pad_cols, 0, pad_rows))
    tiles = padded.view((rows + pad_rows) // br, br, (cols + pad_cols) // bc, bc)
    scale = scale_from_amax(tiles.abs().amax(dim=(1, 3)), fp8_max(dtype), qparams)
    data = _scaled_cast_eager(tiles, scale[:, None, :, None], fp8_max(dtype), dtype)
    data = data.view_as(padded)
    return Quantized(data[:rows, :cols].contiguous(), torch.reciprocal(scale), block)


def expand_scale(q: Quantized) -> torch.Tensor:
    """scale_inv broadcast to the data's shape (per block), or the 0-d scale_inv."""
    if q.block is None:
        return q.scale_inv
    rows, cols = q.data.shape
    full = q.scale_inv.repeat_interleave(q.block[0], dim=0)[:rows]
    return full.repeat_interleave(q.block[1], dim=1)[:, :cols]


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The high-precision tensor `q` stands for, `data * scale_inv`, computed in fp32."""
    return (q.data.float() * expand_scale(q)).to(dtype)


def transpose(q: Quantized) -> Quantized:
    """`q` transposed, `[cols, rows]` contiguous, without casting again: exact for per-tensor
    and square-block scales (1x128 blocks would become 128x1; quantize the transpose instead)."""
    if q.block is not None and q.block[0] != q.block[1]:
        raise ValueError(f"a {q.block[0]}x{q.block[1]}-block tensor cannot be transposed exactly")
    scale_inv = q.scale_inv if q.block is None else q.scale_inv.t().contiguous()
    return Quantized(q.data.t().contiguous(), scale_inv, q.block)


def delayed_update(
    history: torch.Tensor, scale: torch.Tensor, max_value: float, recipe: DelayedScaling
) -> None:
    """End of a step under delayed scaling, in place: `history [L, n]` (slot 0 holds this step's
    amaxes) -> the amax per column by `recipe.amax_compute_algo`, the new `scale [n]` from it,
    and the history rolled by one with slot 0 zeroed for the next step.

    Default scale: `max_value / amax / 2**margin`, keeping the old scale where the amax is 0 or
    not finite and using fp32's max where the quotient overflows."""
    algo = recipe.amax_compute_algo
    if callable(algo):
        a = algo(history)
    elif algo == "max":
        a = history.amax(dim=0)
    else:  # "most_recent"
        a = history[0].clone()
    if history.shape[0] > 1:
        history.copy_(torch.roll(history, -1, dims=0))
    history[0].zero_()
    if recipe.scaling_factor_compute_algo is not None:
        new = recipe.scaling_factor_compute_algo(a, scale, max_value, recipe)
    else:
        new = (max_value / a) / (2**recipe.margin)
        new = torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new)
        new = torch.where((a > 0) & torch.isfinite(a), new, scale)
    scale.copy_(new)


__all__ = [
    "Quantized",
    "amax",
    "delayed_update",
    "dequantize",
    "fp8_dtype",
    "fp8_max",
    "quantize",
    "quantize_blocks",
    "scale_from_amax",
    "transpose",
]
