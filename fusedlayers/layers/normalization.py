"""LayerNorm and RMSNorm with TransformerEngine's parameter names and `zero_centered_gamma`.

Shapes: any `[..., hidden]` input (`[s, b, hidden]`, `[b, s, hidden]` or `[t, hidden]`), normalized
over the last dimension; output has the input's shape and dtype.

Two paths behind one entry, `apply_normalization`:
- kernel: the fused Triton kernels of `fusedlayers.kernels.layer_norm` (one pass over x forward,
  one backward; fp32 statistics; deterministic parameter gradients), for fp16/bf16/fp32 with
  hidden <= `MAX_NORM_HIDDEN`. `backend="kernel"` asks for them (CPU tensors need
  `TRITON_INTERPRET=1`); `auto` takes them for CUDA tensors whose hidden size is at least
  `KERNEL_MIN_HIDDEN`, where the H100 measured them faster (see its comment), and for calls of
  at most `KERNEL_MAX_FEW_ROWS` rows, which are bound by launches.
- reference: torch's `F.layer_norm` / `F.rms_norm` on an fp32 copy of the input (fp64 for fp64):
  TE's norm kernels accumulate in fp32 whatever the input dtype, and a bf16 `rms_norm` would not.
  `use_reference=True` (or `reference_mode()`), CPU tensors, fp64 and oversized rows take it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._backend import choose_backend
from .._logging import debug_enabled, log_decision
from ..reference_switch import ReferenceSwitch

try:
    from ..kernels import MAX_NORM_HIDDEN, NORM_DTYPES, add_layer_norm, layer_norm
except ImportError as error:  # Triton missing (no Linux wheel) or broken: the reference serves
    layer_norm = add_layer_norm = None
    _KERNELS_MISSING = f"kernels unavailable ({error})"
    MAX_NORM_HIDDEN, NORM_DTYPES = 0, ()
else:
    _KERNELS_MISSING = None

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# The smallest hidden size for which `auto` (what the modules use) sends CUDA tensors to the Triton
# kernels; None keeps them off. Measured on the H100, bf16, 16384 rows, against this module's
# fp32 torch path (docs/performance.md, "Norm, RoPE and activation kernels"): at hidden 4096 and
# 8192 the kernels are 5-6.7x faster forward and 2.4-4.6x forward+backward; at 1024 and 2048 the
# forward wins but the backward loses (0.6-1.2x forward+backward), so smaller rows keep the torch
# path.
KERNEL_MIN_HIDDEN: int | None = 4096
# Calls of at most this many rows (a decode step: one row per sequence) take the kernel at any
# hidden size: they are bound by launches, and the kernel is one launch where the fp32 torch path
# is four (x and the weight cast up, the norm, the result cast down).
KERNEL_MAX_FEW_ROWS = 256


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization ({normalization!r}) must be one of {NORMALIZATIONS}")


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """What neither path can take: a missing hidden dim, non-float tensors, parameter shapes,
    parameters on another device (the kernel would read a CPU pointer from the GPU)."""
    if x.dim() < 1:
        raise ValueError(f"x must have a hidden (last) dimension, got a 0-d tensor ({x.shape})")
    hidden = x.shape[-1]
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} dtype ({t.dtype}) must be a floating-point dtype")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (hidden,):
            raise ValueError(
                f"{name} shape ({tuple(t.shape)}) must be (hidden,) = ({hidden},), the last "
                f"dimension of x ({tuple(x.shape)})"
            )
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def _kernel_blocker(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """Why the Triton kernel cannot take this call ("" when it can), naming argument and value."""
    if _KERNELS_MISSING is not None:
        return _KERNELS_MISSING
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in NORM_DTYPES:
            return f"{name} dtype ({t.dtype}) is not one the norm kernel takes {NORM_DTYPES}"
    if x.shape[-1] > MAX_NORM_HIDDEN:
        return f"hidden size ({x.shape[-1]}) exceeds the norm kernel's {MAX_NORM_HIDDEN}"
    if x.numel() == 0:
        return f"x is empty ({tuple(x.shape)})"
    return ""


def _use_kernel(backend: str, x, weight, bias) -> tuple[bool, str]:
    """(run the kernel?, why): `choose_backend`, with `auto` keeping rows under the measured
    break-even (KERNEL_MIN_HIDDEN) on the reference path, unless the call has few rows."""
    not_worth = ""
    few_rows = x.numel() <= KERNEL_MAX_FEW_ROWS * x.shape[-1]
    if not few_rows and (KERNEL_MIN_HIDDEN is None or x.shape[-1] < KERNEL_MIN_HIDDEN):
        not_worth = (
            f"hidden size ({x.shape[-1]}) below the norm kernels' measured break-even "
            f"(KERNEL_MIN_HIDDEN={KERNEL_MIN_HIDDEN})"
        )
    return choose_backend(backend, x, "x", _kernel_blocker(x, weight, bias), not_worth)


def normalization_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    normalization: str = "LayerNorm",
    zero_centered_gamma: bool = False,
) -> torch.Tensor:
    """The torch path: `F.layer_norm` / `F.rms_norm` in fp32 (fp64 for fp64), x's dtype out."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    gamma = weight.to(compute)
    if zero_centered_gamma:
        gamma = gamma + 1
    shape = (x.shape[-1],)
    if normalization == "RMSNorm":
        out = F.rms_norm(x.to(compute), shape, gamma, eps)
    else:
        beta = None if bias is None else bias.to(compute)
        out = F.layer_norm(x.to(compute), shape, gamma, beta, eps)
    return out.to(x.dtype)


def apply_normalization(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    normalization: str = "LayerNorm",
    zero_centered_gamma: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Normalize `x [..., hidden]` over its last dimension with fp32 statistics, in x's dtype.

    LayerNorm: `(x - mean) / sqrt(var + eps) * gamma + beta`; RMSNorm: `x / sqrt(mean(x^2) + eps)
    * gamma` (a bias is ignored, as TE's RMSNorm has none). With `zero_centered_gamma` the stored
    weight is `gamma - 1` (TE's convention), so a freshly initialized layer (weight 0) is the
    identity scale. `weight`/`bias` are `[hidden]`.

    backend: `auto` runs the Triton kernel on CUDA tensors it supports and the torch reference
    otherwise; `kernel` insists (ValueError naming what it cannot take; CPU tensors need
    `TRITON_INTERPRET=1`); `reference` is the fp32 torch path. The modules pass `reference` when
    their `use_reference` switch is on, else `auto`.
    """
    bias, rms, use_kernel = _choose_path(x, weight, bias, normalization, backend, "kernel")
    if not use_kernel:
        return normalization_reference(x, weight, bias, eps, normalization, zero_centered_gamma)
    return layer_norm(x, weight, bias, eps, rms=rms, zero_centered_gamma=zero_centered_gamma)


def _choose_path(x, weight, bias, normalization, backend, kernel_label):
    """The checks and the path choice both entry points share: (bias, rms, use_kernel), the
    bias dropped for RMSNorm; the choice is logged under `kernel_label` when debugging."""
    check_normalization(normalization)
    _check_inputs(x, weight, bias)
    rms = normalization == "RMSNorm"
    if rms:
        bias = None
    use_kernel, why = _use_kernel(backend, x, weight, bias)
    if debug_enabled():
        log_decision(normalization, (f"{kernel_label}: " if use_kernel else "reference: ") + why)
    return bias, rms, use_kernel


def fusible_add(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether `apply_add_normalization` takes this pair: one shape, dtype and device. Under
    autocast a branch output may be bf16 on an fp32 residual stream; callers then add
    explicitly, as torch's add promotes."""
    return residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device


def residual_for_fusion(
    x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(x, residual)` ready for a fused add and norm: unchanged, or `(residual + x, None)`
    where only their dtypes differ (under autocast a branch output is bf16 while the residual
    stream stays fp32), added as torch's add promotes: what an explicit add before the norm
    computes. A shape or device mismatch passes through, for the norm's ValueError."""
    if (
        residual is not None
        and residual.dtype != x.dtype
        and residual.shape == x.shape
        and residual.device == x.device
    ):
        return residual + x, None
    return x, residual


def apply_add_normalization(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    normalization: str = "LayerNorm",
    zero_centered_gamma: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(apply_normalization(h, ...), h)` with `h = residual + x`: a transformer block's residual
    add and the next norm. On the kernel path the two are one pass (`add_layer_norm`); h is
    rounded to x's dtype as the separate add rounds it, so the result is the same either way.

    x, residual: `[..., hidden]` of one shape, dtype and device; the rest as
    `apply_normalization`, whose rules pick the path (on h's shape).
    """
    if not fusible_add(x, residual):
        raise ValueError(
            f"residual ({tuple(residual.shape)}, {residual.dtype}, {residual.device}) must "
            f"match the input it is added to ({tuple(x.shape)}, {x.dtype}, {x.device})"
        )
    bias, rms, use_kernel = _choose_path(
        x, weight, bias, normalization, backend, "kernel, with the residual add"
    )
    if not use_kernel:
        h = residual + x
        return normalization_reference(h, weight, bias, eps, normalization, zero_centered_gamma), h
    return add_layer_norm(
        x, residual, weight, bias, eps, rms=rms, zero_centered_gamma=zero_centered_gamma
    )


def normalize_input(
    x: torch.Tensor, residual: torch.Tensor | None, *norm_args, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's input norm: `(apply_normalization(x, ...), x)`, or with a residual
    `apply_add_normalization(x, residual, ...)`, whose second value is the sum `residual + x`.
    `norm_args`: weight, bias, eps, normalization, zero_centered_gamma."""
    if residual is None:
        return apply_normalization(x, *norm_args, backend=backend), x
    return apply_add_normalization(x, residual, *norm_args, backend=backend)


class _Norm(ReferenceSwitch):
    """Shared body of LayerNorm and RMSNorm: `weight [hidden]` (and `bias [hidden]`)."""

    normalization = "LayerNorm"

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        use_reference: bool = False,
    ) -> None:
        super().__init__(use_reference)
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        factory = dict(dtype=params_dtype or torch.get_default_dtype(), device=device)
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, **factory))
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, inp: torch.Tensor, residual: torch.Tensor | None = None):
        """`inp [..., hidden]` -> same shape and dtype.

        `residual` (fusedlayers' own, not TE's; inp's shape, dtype and device): normalize
        `residual + inp` instead and return `(normalized, residual + inp)`, the add fused into
        the norm on the kernel path (`apply_add_normalization`)."""
        args = (self.weight, self.bias, self.eps, self.normalization, self.zero_centered_gamma)
        backend = "reference" if self.reference_active else "auto"
        normed, total = normalize_input(inp, residual, *args, backend=backend)
        return normed if residual is None else (normed, total)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """TE's `LayerNorm(hidden_size, eps, zero_centered_gamma, params_dtype, device)`: parameters
    `weight`, `bias`."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """TE's `RMSNorm(hidden_size, eps, zero_centered_gamma, params_dtype, device)`: parameter
    `weight` only."""

    normalization = "RMSNorm"


def make_norm(normalization: str, hidden_size: int, **kwargs) -> _Norm:
    """`LayerNorm` or `RMSNorm` by TE's `normalization` name."""
    check_normalization(normalization)
    return (LayerNorm if normalization == "LayerNorm" else RMSNorm)(hidden_size, **kwargs)
