"""FP8 recipes with TransformerEngine's names, fields and defaults (TE's `common.recipe`).

A recipe says how tensors are scaled into FP8; `fusedlayers.fp8_autocast(fp8_recipe=...)` (or
`fusedlayers.autocast(recipe=...)`) chooses one for the GEMMs of `Linear`, `LayerNormLinear`,
`LayerNormMLP` and the modules built from them.

    Format               E4M3, E5M2, HYBRID (E4M3 forward, E5M2 for gradients), E2M1 (FP4)
    DelayedScaling       one scale per tensor, from the amax history of earlier steps
    Float8CurrentScaling one scale per tensor, from the tensor's own amax at each cast
    Float8BlockScaling   one scale per 1x128 block (activations, gradients) or 128x128 block
                         (weights), from the block's amax
    MXFP8BlockScaling, NVFP4BlockScaling
                         Blackwell (sm_100) formats: they can be built and saved, but an
                         `fp8_autocast(enabled=True)` with them raises (not implemented here)

`fp8_dpa` / `fp8_mha` (FP8 attention) are accepted and kept, but the attention does not read them
yet: `DotProductAttention` runs in the activation dtype (bf16) inside `fp8_autocast`, and the
autocast logs once that it does. Bad fields raise `ValueError` naming the field and its value.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


class _FormatHelper(NamedTuple):
    """The largest finite value of the forward and of the backward FP8 dtype of a `Format`.

    The values equal TransformerEngine's, so a TE checkpoint's pickled `Format` maps onto this
    enum by value."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8 (and FP4) formats: `E4M3` everywhere, `E5M2` everywhere, `HYBRID` (E4M3 for forward
    tensors: inputs, weights; E5M2 for gradients), `E2M1` (NVFP4's 4-bit elements)."""

    E2M1 = _FormatHelper(max_fwd=6.0, max_bwd=6.0)
    E4M3 = _FormatHelper(max_fwd=448.0, max_bwd=448.0)
    E5M2 = _FormatHelper(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = _FormatHelper(max_fwd=448.0, max_bwd=57344.0)


@dataclass(frozen=True)
class QParams:
    """How one role's tensors are cast: `power_2_scale` rounds each scale down to a power of 2
    (exact to apply and to invert); `amax_epsilon` is a floor under the amax."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0


@dataclass(frozen=True)
class MMParams:
    """GEMM options: `use_split_accumulator=False` lets Hopper's tensor cores accumulate FP8
    products in their faster, less precise mode (torch `_scaled_mm`'s `use_fast_accum=True`)."""

    use_split_accumulator: bool = True


class Recipe:
    """Base of every recipe; the class methods say which kind a recipe is (TE's helpers)."""

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        return issubclass(cls, NVFP4BlockScaling)


def _check_format(recipe: str, value, allowed: tuple[Format, ...], name="fp8_format") -> None:
    if value not in allowed:
        names = ", ".join(f"Format.{f.name}" for f in allowed)
        raise ValueError(f"{recipe}: {name} ({value!r}) must be one of {names}")


def _check_flag(recipe: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{recipe}: {name} ({value!r}) must be True or False")


@dataclass
class DelayedScaling(Recipe):
    """Per-tensor scales computed from the amaxes of earlier steps (TE's default recipe).

    Each FP8 tensor of a module keeps an `amax_history [amax_history_len]`. A step casts with the
    scale computed at the end of the previous step, records this step's amax in slot 0, and at
    the end of the step (the outermost `fp8_autocast` exit for forward tensors, the end of the
    backward for gradients) the history is reduced to one amax (`amax_compute_algo`: `"max"` of
    the window, `"most_recent"`, or a callable `history [L, n] -> amax [n]`), the scale becomes
    `fp8_max / amax / 2**margin` (or `scaling_factor_compute_algo(amax, scale, fp8_max,
    recipe)`), and the history rolls by one with slot 0 zeroed. An amax of 0 or inf/NaN keeps
    the previous scale. With `reduce_amax` and torch.distributed initialized, the amaxes are
    all-reduced (MAX) over the autocast's group first, so every rank keeps the same scales.

    `fp8_dpa`, `fp8_mha`: FP8 attention, accepted for TE compatibility and not used yet.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable = "max"
    scaling_factor_compute_algo: Callable | None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"{name}: margin ({self.margin!r}) must be a non-negative integer")
        _check_format(name, self.fp8_format, (Format.E4M3, Format.HYBRID))
        length = self.amax_history_len
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"{name}: amax_history_len ({length!r}) must be a positive integer")
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"{name}: amax_compute_algo ({algo!r}) must be one of {AMAX_COMPUTE_ALGOS} or "
                "a callable taking the amax history [amax_history_len, n] and returning [n]"
            )
        sf = self.scaling_factor_compute_algo
        if sf is not None and not callable(sf):
            raise ValueError(f"{name}: scaling_factor_compute_algo ({sf!r}) must be callable")
        for flag in ("reduce_amax", "fp8_dpa", "fp8_mha"):
            _check_flag(name, flag, getattr(self, flag))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


def _default_qparams(recipe: Recipe, power_2_scale: bool) -> None:
    """Fill the per-role QParams a recipe was not given (inputs, weights, gradients)."""
    for role in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        if getattr(recipe, role) is None:
            setattr(recipe, role, QParams(power_2_scale=power_2_scale))


@dataclass
class Float8CurrentScaling(Recipe):
    """Per-tensor scales from each tensor's own amax, computed at every cast: `fp8_max / amax`
    (1 when the amax is 0 or not finite), rounded down to a power of 2 with
    `use_power_2_scales` (default from `NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES`, as in TE).

    `fp8_quant_fwd_inp`, `fp8_quant_fwd_weight`, `fp8_quant_bwd_grad` (QParams) default from
    `use_power_2_scales`; `fp8_gemm_fprop` accumulates fast by default, dgrad and wgrad do not.
    """

    use_power_2_scales: bool = field(
        default_factory=lambda: _env_flag("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES")
    )
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: MMParams(False))
    fp8_gemm_dgrad: MMParams = field(default_factory=lambda: MMParams(True))
    fp8_gemm_wgrad: MMParams = field(default_factory=lambda: MMParams(True))
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_format(name, self.fp8_format, (Format.E4M3, Format.HYBRID))
        _check_flag(name, "use_power_2_scales", self.use_power_2_scales)
        _default_qparams(self, power_2_scale=self.use_power_2_scales)
        for flag in ("fp8_dpa", "fp8_mha"):
            _check_flag(name, flag, getattr(self, flag))


BLOCK = 128  # the side of Float8BlockScaling's blocks: 1x128 (dim 1) or 128x128 (dim 2)


@dataclass
class Float8BlockScaling(Recipe):
    """One scale per block: activations (`x_block_scaling_dim=1`) and gradients
    (`grad_block_scaling_dim=1`) in 1x128 blocks along the GEMM's inner dimension, weights
    (`w_block_scaling_dim=2`) in 128x128 blocks; 2 means 128x128 for any of them, but two
    operands of one GEMM may not both be 2D. Scales are powers of 2 unless
    `NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1` (as in TE). All tensors E4M3 by default.

    In fusedlayers the block-scaled tensors are dequantized and multiplied in the activation
    dtype (no blockwise FP8 GEMM is called): the numerics of block scaling, the speed of bf16.
    """

    use_f32_scales: bool = field(
        default_factory=lambda: _env_flag("NVTE_FP8_BLOCK_SCALING_FP32_SCALES")
    )
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = field(default_factory=MMParams)
    fp8_gemm_dgrad: MMParams = field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_format(name, self.fp8_format, (Format.E4M3, Format.HYBRID))
        _check_flag(name, "use_f32_scales", self.use_f32_scales)
        _default_qparams(self, power_2_scale=not self.use_f32_scales)
        dims = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
        for dim in dims:
            if getattr(self, dim) not in (1, 2):
                raise ValueError(f"{name}: {dim} ({getattr(self, dim)!r}) must be 1 or 2")
        for a, b in ((0, 1), (0, 2), (1, 2)):
            if getattr(self, dims[a]) == 2 and getattr(self, dims[b]) == 2:
                raise ValueError(
                    f"{name}: {dims[a]} and {dims[b]} are both 2; a GEMM cannot take 128x128 "
                    "blocks on both operands"
                )
        for gemm in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, gemm).use_split_accumulator:
                raise ValueError(f"{name}: {gemm} must use the split accumulator")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError(f"{name}: FP8 attention (fp8_dpa, fp8_mha) is not supported")


@dataclass
class MXFP8BlockScaling(Recipe):
    """MXFP8: E4M3 elements with one power-of-2 (E8M0) scale per 32 consecutive values. Needs
    a Blackwell GPU (sm_100) and is not implemented in fusedlayers: it can be built and saved,
    and `fp8_autocast(enabled=True)` with it raises."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_format(type(self).__name__, self.fp8_format, (Format.E4M3, Format.HYBRID))


@dataclass
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 (4-bit) elements with an E4M3 scale per 16 values and one FP32 scale per
    tensor. Needs a Blackwell GPU (sm_100) and is not implemented in fusedlayers: it can be
    built and saved, and `fp8_autocast(enabled=True)` with it raises."""

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_format(name, self.fp4_format, (Format.E2M1,), "fp4_format")
        _check_format(name, self.fp8_format, (Format.E4M3,))


BLACKWELL_ONLY = (MXFP8BlockScaling, NVFP4BlockScaling)

__all__ = [
    "BLOCK",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
]
