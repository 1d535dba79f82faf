"""`Linear` and `LayerNormLinear` with TransformerEngine's parameter names and split parameters.

Shapes: input `[..., in_features]` (`[s, b, hidden]`, `[b, s, hidden]` or `[t, hidden]`) ->
output `[..., out_features]`.

Parameters (TE names): `weight [out, in]`, `bias [out]`; with `parameters_split` the weight is one
`[out, in]` buffer exposed as `{name}_weight` / `{name}_bias` row-slices of it (e.g. `query_weight`,
`key_weight`, `value_weight`). The forward re-joins the slices without a copy while they still
sit side by side in one storage; `LayerNormLinear` adds `layer_norm_weight` (and
`layer_norm_bias` for LayerNorm) in front.

Inside `fp8_autocast` the GEMM runs in FP8 (`gemm_module.GemmModule`); every module
checkpoints its FP8 metadata as TE's `_extra_state` entry (an empty uint8 tensor before any FP8
run, as TE saves it), and loads TE's entries, with or without FP8 state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .gemm_module import GemmModule, linear
from .normalization import check_normalization, normalize_input

# TE's `get_default_init_method()`: normal(0, 0.023).
DEFAULT_INIT_STD = 0.023


def default_init_method(weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


class _NoopCat(torch.autograd.Function):
    """Join row-slices that are adjacent in one storage into a single tensor, without a copy.

    The slices are separate Parameters (TE's split names), so autograd must route the joined
    tensor's gradient back to each slice: the backward splits it along dim 0.
    """

    @staticmethod
    def forward(ctx, *parts: torch.Tensor) -> torch.Tensor:
        ctx.sizes = [p.shape[0] for p in parts]
        first = parts[0]
        shape = (sum(ctx.sizes), *first.shape[1:])
        joined = first.new_empty(0)
        joined.set_(first.untyped_storage(), first.storage_offset(), shape, first.stride())
        return joined

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return tuple(grad.split(ctx.sizes, dim=0))


def _adjacent(parts: Sequence[torch.Tensor]) -> bool:
    """Whether contiguous `parts` follow each other in one storage (so one view covers them)."""
    if not all(p.is_contiguous() for p in parts):
        return False
    storage = parts[0].untyped_storage().data_ptr()
    offset = parts[0].storage_offset()
    for p in parts:
        if p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


def join_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0: a view when adjacent in memory, else `torch.cat` (one copy)."""
    if len(parts) == 1:
        return parts[0]
    # Under torch.compile the storage tricks cannot be traced; the compiler plans the concat.
    if not torch.compiler.is_compiling() and _adjacent(parts):
        return _NoopCat.apply(*parts)
    return torch.cat(parts, dim=0)


def split_sizes(out_features: int, parameters_split) -> tuple[list[str], list[int]]:
    """TE's `parameters_split`: None, names (even split) or {name: rows} -> (names, row counts)."""
    if parameters_split is None:
        return [""], [out_features]
    if isinstance(parameters_split, Mapping):
        names, sizes = list(parameters_split), list(parameters_split.values())
    else:
        names = list(parameters_split)
        if not names or out_features % len(names):
            raise ValueError(
                f"out_features ({out_features}) must split evenly into {len(names)} parameters"
            )
        sizes = [out_features // len(names)] * len(names)
    if sum(sizes) != out_features:
        raise ValueError(f"parameters_split sizes {sizes} do not add up to {out_features}")
    return [n.rstrip("_") + "_" for n in names], sizes


class _SplitWeights(GemmModule):
    """Holds `[out, in]` weight (and `[out]` bias) as TE-named row-slices of one buffer."""

    def _init_weights(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        init_method: Callable | None,
        parameters_split,
        params_dtype: torch.dtype | None,
        device,
    ) -> None:
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        names, sizes = split_sizes(out_features, parameters_split)
        self.weight_names = [f"{n}weight" for n in names]
        self.bias_names = [f"{n}bias" for n in names] if bias else []
        if not bias:  # TE keeps the attribute (empty) when there is no bias
            for n in names:
                setattr(self, f"{n}bias", None)
        factory = dict(dtype=params_dtype or torch.get_default_dtype(), device=device)
        weight = torch.empty(out_features, in_features, **factory)
        bias_buffer = torch.zeros(out_features, **factory) if bias else None
        init = init_method or default_init_method
        with torch.no_grad():
            for i, rows in enumerate(weight.split(sizes)):
                init(rows)
                self.register_parameter(self.weight_names[i], torch.nn.Parameter(rows))
                if bias:
                    self.register_parameter(
                        self.bias_names[i], torch.nn.Parameter(bias_buffer.split(sizes)[i])
                    )
        self._init_fp8()  # after the weights: fp8_model_init casts them

    def joined_weight(self) -> torch.Tensor:
        """`[out, in]`, a view over the split parameters when they are still adjacent."""
        return join_rows([getattr(self, n) for n in self.weight_names])

    def joined_bias(self) -> torch.Tensor | None:
        if not self.use_bias:
            return None
        return join_rows([getattr(self, n) for n in self.bias_names])

    def _gemm_weight_names(self, gemm: int) -> list[str]:
        return self.weight_names

    def _gemm_weight(self, gemm: int) -> torch.Tensor:
        return self.joined_weight()

    def _repack(self) -> None:
        """Put split parameters that lost adjacency back into one buffer (same Parameters)."""
        for names in (self.weight_names, self.bias_names):
            params = [getattr(self, n) for n in names]
            if len(params) > 1 and not _adjacent(params):
                dtype = params[0].dtype
                # FP8 weights (fp8_model_init) are joined as bytes: not every device cats FP8.
                raw = torch.uint8 if dtype.itemsize == 1 else dtype
                packed = torch.cat([p.data.view(raw) for p in params], dim=0)
                for p, rows in zip(params, packed.split([p.shape[0] for p in params])):
                    p.data = rows.view(dtype)

    def _after_apply(self) -> None:
        # `.to()` / `.cuda()` give every slice its own storage; pack them into one buffer again
        # so the forward keeps joining them without a copy.
        self._repack()

    def __setstate__(self, state) -> None:
        # `copy.deepcopy` and unpickling copy each parameter on its own: pack them again.
        super().__setstate__(state)
        self._repack()


class Linear(_SplitWeights):
    """TE's `Linear(in_features, out_features, bias, init_method, parameters_split,
    return_bias, params_dtype, device)`: `[..., in_features] -> [..., out_features]`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method: Callable | None = None,
        parameters_split=None,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        use_reference: bool = False,
    ) -> None:
        super().__init__(use_reference)
        self.return_bias = return_bias
        self._init_weights(
            in_features, out_features, bias, init_method, parameters_split, params_dtype, device
        )

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        """`inp [..., in]` -> `[..., out]` (and the bias `[out]` when `return_bias`); in FP8
        inside `fp8_autocast`, where `is_first_microbatch` caches the FP8 weight (see
        `gemm_module`)."""
        bias = self.joined_bias()
        weight = self.joined_weight()
        if self.return_bias:
            return self._gemm(inp, weight, None, 0, is_first_microbatch), bias
        return self._gemm(inp, weight, bias, 0, is_first_microbatch)


class LayerNormLinear(_SplitWeights):
    """TE's `LayerNormLinear`: normalization (`layer_norm_weight`, `layer_norm_bias`) then a linear
    layer; `[..., in_features] -> [..., out_features]`, plus the normalized input
    `[..., in_features]` when `return_layernorm_output`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        init_method: Callable | None = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        parameters_split=None,
        zero_centered_gamma: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        use_reference: bool = False,
    ) -> None:
        super().__init__(use_reference)
        check_normalization(normalization)
        self.eps = eps
        self.normalization = normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.return_bias = return_bias
        self.return_layernorm_output = return_layernorm_output
        factory = dict(dtype=params_dtype or torch.get_default_dtype(), device=device)
        gamma = 0.0 if zero_centered_gamma else 1.0
        self.layer_norm_weight = torch.nn.Parameter(torch.full((in_features,), gamma, **factory))
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features, **factory))
        else:
            self.register_parameter("layer_norm_bias", None)
        self._init_weights(
            in_features, out_features, bias, init_method, parameters_split, params_dtype, device
        )

    def forward(
        self,
        inp: torch.Tensor,
        residual: torch.Tensor | None = None,
        is_first_microbatch: bool | None = None,
    ):
        """`inp [..., in]` -> `out [..., out]`, then `bias` if `return_bias`, then the normalized
        input if `return_layernorm_output` (a tuple when anything is added). The GEMM runs in
        FP8 inside `fp8_autocast`, where `is_first_microbatch` caches the FP8 weight (TE's
        argument; see `gemm_module`).

        `residual` (fusedlayers' own, not TE's; inp's shape, dtype and device): the layer runs
        on `residual + inp` and that sum `[..., in]` is returned last, for the block's next
        residual add. On the kernel path the add is fused into the norm
        (`apply_add_normalization`), as `LayerNormMLP`'s `residual` is."""
        norm_args = (
            self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization,
            self.zero_centered_gamma,
        )  # fmt: skip
        backend = "reference" if self.reference_active else "auto"
        ln_out, inp = normalize_input(inp, residual, *norm_args, backend=backend)
        bias = self.joined_bias()
        out = self._gemm(
            ln_out, self.joined_weight(), None if self.return_bias else bias, 0, is_first_microbatch
        )
        outputs = (out,)
        if self.return_bias:
            outputs += (bias,)
        if self.return_layernorm_output:
            outputs += (ln_out,)
        if residual is not None:
            outputs += (inp,)
        return outputs if len(outputs) > 1 else out


__all__ = ["Linear", "LayerNormLinear", "default_init_method", "linear"]
