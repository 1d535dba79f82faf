"""`LayerNormMLP`: normalization -> FC1 -> activation -> FC2, with TransformerEngine's names.

Shapes: `[..., hidden]` (`[s, b, hidden]`, `[b, s, hidden]` or `[t, hidden]`) -> `[..., hidden]`.

Parameters (TE names): `layer_norm_weight [hidden]`, `layer_norm_bias [hidden]` (LayerNorm only),
`fc1_weight [ffn * k, hidden]`, `fc1_bias`, `fc2_weight [hidden, ffn]`, `fc2_bias`, where
`k = 2` for gated activations (FC1 computes both halves) and 1 otherwise.

Activations follow TE's definitions: `gelu` is the tanh approximation, `qgelu(x) = x *
sigmoid(1.702 x)`, `srelu(x) = relu(x)^2`; a gated `*glu` applies its activation to the first half
of FC1's output and multiplies by the second half.

Two paths behind one entry, `apply_activation`:
- kernel: the fused Triton kernels of `fusedlayers.kernels.fused_activation` (one pass forward,
  one backward that recomputes the activation and writes both halves of a gated gradient), for
  fp16/bf16/fp32. `backend="kernel"` asks for them (CPU tensors need `TRITON_INTERPRET=1`);
  `auto` takes them for CUDA tensors.
- reference: the PyTorch functions below (`activation_reference`), also the tests' oracle.
  `use_reference=True` (or `reference_mode()`), CPU tensors and fp64 take it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .._backend import choose_backend
from .._logging import debug_enabled, log_decision
from .gemm_module import GemmModule
from .linear import default_init_method
from .normalization import check_normalization, normalize_input

try:
    from ..kernels import ACTIVATION_DTYPES, fused_activation
except ImportError as error:  # Triton missing (no Linux wheel) or broken: the reference serves
    fused_activation, _KERNELS_MISSING = None, f"kernels unavailable ({error})"
    ACTIVATION_DTYPES = ()
else:
    _KERNELS_MISSING = None


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _qgelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _srelu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu,
    "relu": F.relu,
    "qgelu": _qgelu,
    "srelu": _srelu,
    "silu": F.silu,
}
# Gated variant name -> activation applied to the first half.
_GATED = {"geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu", "sreglu": "srelu", "swiglu": "silu"}

ACTIVATIONS = tuple(_ACTIVATIONS) + tuple(_GATED)


def is_gated(activation: str) -> bool:
    return activation in _GATED


def activation_reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The PyTorch path: `x [..., n]` -> `[..., n]`, or `[..., n / 2]` for a gated activation,
    computed by torch in x's dtype."""
    if activation in _GATED:
        first, second = x.chunk(2, dim=-1)
        return _ACTIVATIONS[_GATED[activation]](first) * second
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation ({activation!r}) must be one of {ACTIVATIONS}")
    return _ACTIVATIONS[activation](x)


def _check_inputs(x: torch.Tensor, activation: str) -> None:
    """What neither path can take: an unknown name, a gated activation without two equal halves."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation ({activation!r}) must be one of {ACTIVATIONS}")
    if is_gated(activation) and (x.dim() == 0 or x.shape[-1] % 2):
        raise ValueError(
            f"activation ({activation!r}) is gated and needs x with an even last dimension (its "
            f"two halves), got x of shape {tuple(x.shape)}"
        )


def _kernel_blocker(x: torch.Tensor) -> str:
    """Why the Triton kernel cannot take this call ("" when it can), naming argument and value."""
    if _KERNELS_MISSING is not None:
        return _KERNELS_MISSING
    if x.dtype not in ACTIVATION_DTYPES:
        return f"x dtype ({x.dtype}) is not one the activation kernel takes {ACTIVATION_DTYPES}"
    if x.dim() == 0:
        return f"x is 0-d ({tuple(x.shape)}); the kernel needs a last dimension"
    return ""


def _use_kernel(backend: str, x: torch.Tensor) -> tuple[bool, str]:
    """(run the kernel?, why): `choose_backend` for the activation kernels."""
    return choose_backend(backend, x, "x", _kernel_blocker(x))


def apply_activation(x: torch.Tensor, activation: str, backend: str = "auto") -> torch.Tensor:
    """`x [..., n]` -> `[..., n]`, or `[..., n / 2]` for a gated activation (n even), x's dtype.

    backend: `auto` runs the fused Triton kernels on CUDA tensors of fp16/bf16/fp32 and the
    PyTorch reference otherwise (CPU tensors, fp64); `kernel` insists (ValueError naming what it
    cannot take; CPU tensors need `TRITON_INTERPRET=1`); `reference` is the PyTorch path.
    `LayerNormMLP` passes `reference` when its `use_reference` switch is on, else `auto`.
    """
    _check_inputs(x, activation)
    use_kernel, why = _use_kernel(backend, x)
    if debug_enabled():
        path = "kernel: " if use_kernel else "reference: "
        log_decision(f"activation {activation}", path + why)
    if not use_kernel:
        return activation_reference(x, activation)
    return fused_activation(x, activation)


class LayerNormMLP(GemmModule):
    """TE's `LayerNormMLP(hidden_size, ffn_hidden_size, eps, bias, normalization, activation,
    init_method, output_layer_init_method, return_bias, return_layernorm_output,
    zero_centered_gamma, params_dtype, device)`."""

    num_gemms = 2  # FC1 (TE's GEMM 1), FC2 (GEMM 2): TE's FP8 metadata layout

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        zero_centered_gamma: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        use_reference: bool = False,
    ) -> None:
        super().__init__(use_reference)
        check_normalization(normalization)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation ({activation!r}) must be one of {ACTIVATIONS}")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.eps = eps
        self.normalization = normalization
        self.activation = activation
        self.use_bias = bias
        self.return_bias = return_bias
        self.return_layernorm_output = return_layernorm_output
        self.zero_centered_gamma = zero_centered_gamma
        factory = dict(dtype=params_dtype or torch.get_default_dtype(), device=device)
        fc1_rows = 2 * ffn_hidden_size if is_gated(activation) else ffn_hidden_size
        gamma = 0.0 if zero_centered_gamma else 1.0
        self.layer_norm_weight = torch.nn.Parameter(torch.full((hidden_size,), gamma, **factory))
        self.layer_norm_bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, **factory))
            if normalization == "LayerNorm"
            else None
        )
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_rows, hidden_size, **factory))
        self.fc1_bias = torch.nn.Parameter(torch.zeros(fc1_rows, **factory)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **factory))
        self.fc2_bias = torch.nn.Parameter(torch.zeros(hidden_size, **factory)) if bias else None
        with torch.no_grad():
            (init_method or default_init_method)(self.fc1_weight)
            (output_layer_init_method or default_init_method)(self.fc2_weight)
        self._init_fp8()  # after the weights: fp8_model_init casts them

    def _gemm_weight_names(self, gemm: int) -> list[str]:
        return ["fc1_weight" if gemm == 0 else "fc2_weight"]

    def forward(
        self,
        inp: torch.Tensor,
        residual: torch.Tensor | None = None,
        is_first_microbatch: bool | None = None,
    ):
        """`inp [..., hidden]` -> `out [..., hidden]`, then `fc2_bias` if `return_bias`, then the
        normalized input if `return_layernorm_output` (a tuple when anything is added). FC1 and
        FC2 run in FP8 inside `fp8_autocast`, where `is_first_microbatch` caches their FP8
        weights (TE's argument; see `gemm_module`).

        `residual` (fusedlayers' own, not TE's; inp's shape and dtype): the MLP runs on
        `residual + inp` and that sum is returned last, for the block's next residual add. On
        the kernel path the add is fused into the norm (`apply_add_normalization`)."""
        norm_args = (
            self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization,
            self.zero_centered_gamma,
        )  # fmt: skip
        backend = "reference" if self.reference_active else "auto"
        ln_out, inp = normalize_input(inp, residual, *norm_args, backend=backend)
        fc1_out = self._gemm(ln_out, self.fc1_weight, self.fc1_bias, 0, is_first_microbatch)
        hidden = apply_activation(fc1_out, self.activation, backend=backend)
        fc2_bias = None if self.return_bias else self.fc2_bias
        out = self._gemm(hidden, self.fc2_weight, fc2_bias, 1, is_first_microbatch)
        outputs = (out,)
        if self.return_bias:
            outputs += (self.fc2_bias,)
        if self.return_layernorm_output:
            outputs += (ln_out,)
        if residual is not None:
            outputs += (inp,)
        return outputs if len(outputs) > 1 else out


__all__ = ["LayerNormMLP", "ACTIVATIONS", "activation_reference", "apply_activation"]
