"""LayerNorm and RMSNorm with TransformerEngine's parameter names and `zero_centered_gamma`.

Shapes: any `[..., hidden]` input (`[s, b, hidden]`, `[b, s, hidden]` or `[t, hidden]`), normalized
over the last dimension; output has the input's shape and dtype.

Both paths use torch's `F.layer_norm` / `F.rms_norm` on an fp32 copy of the input: TE's norm kernels
accumulate in fp32 whatever the input dtype, and a bf16 `rms_norm` would not. No Triton norm kernel
exists yet, so `use_reference` changes nothing here; the switch is kept so a whole model flips.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference_switch import ReferenceSwitch

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization ({normalization!r}) must be one of {NORMALIZATIONS}")


def apply_normalization(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    normalization: str = "LayerNorm",
    zero_centered_gamma: bool = False,
) -> torch.Tensor:
    """Normalize `x [..., hidden]` over its last dimension, in fp32, returning x's dtype.

    LayerNorm: `(x - mean) / sqrt(var + eps) * gamma + beta`; RMSNorm: `x / sqrt(mean(x^2) + eps)
    * gamma`. With `zero_centered_gamma` the stored weight is `gamma - 1` (TE's convention), so a
    freshly initialized layer (weight 0) is the identity scale.
    """
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

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """`inp [..., hidden]` -> same shape and dtype."""
        return apply_normalization(
            inp, self.weight, self.bias, self.eps, self.normalization, self.zero_centered_gamma
        )

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
