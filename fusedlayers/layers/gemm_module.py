"""The GEMMs of `Linear`, `LayerNormLinear` and `LayerNormMLP`, in high precision or in FP8.

`GemmModule` is their shared base. `self._gemm(x, weight, bias, gemm, is_first_microbatch)` is
`x [..., K] @ weight[N, K]^T + bias`:

- outside `fp8_autocast`: `linear()`, in x's dtype (parameters cast like TE's AMP);
- inside `fp8_autocast(enabled=True)`: `fusedlayers.fp8.gemm.fp8_linear` under the block's
  recipe, on `torch._scaled_mm` for CUDA tensors (sm_89+), emulated on the reference path
  (`use_reference=True`); anywhere else it raises, pointing at the reference path;
- inside `fp8_autocast(enabled=False, calibrating=True)`: `linear()`, recording the amaxes.

It also keeps what TE keeps per module: the FP8 metadata (`fp8_meta`, saved as `_extra_state` in
TE's layout), the FP8 weights cached by `is_first_microbatch`, and FP8-only weights for modules
built inside `fp8_model_init` (`quantized_model_init`).

`is_first_microbatch` (TE's argument, for gradient accumulation): True casts the weight to FP8
and keeps it; False reuses the kept one (the weight has not changed between micro-batches; with
nothing kept yet it casts and keeps); None casts at every call and keeps nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..fp8._torch_compat import E4M3, activation_dtype
from ..fp8.context import require_fp8_support
from ..fp8.extra_state import decode_extra_state, encode_extra_state
from ..fp8.gemm import GemmPlan, WeightOperands, fp8_linear
from ..fp8.meta import FP8Meta
from ..fp8.scaling import Quantized, amax, dequantize, quantize, quantize_blocks, scale_from_amax
from ..fp8.state import STATE
from ..recipe import BLOCK, Recipe
from ..reference_switch import ReferenceSwitch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [..., in] @ weight[out, in]^T + bias` in x's dtype (parameters cast like TE's AMP)."""
    bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight.to(x.dtype), bias)


def _weight_key(recipe: Recipe) -> tuple:
    """What a weight cast depends on besides the weight: the kind of scaling and the format."""
    block = (recipe.w_block_scaling_dim,) if recipe.float8_block_scaling() else ()
    return (recipe.float8_block_scaling(), recipe.fp8_format, *block)


@dataclass
class _FP8Weight:
    """An FP8-only weight (fp8_model_init): its scale_inv, blocks, and the dtype it was built in
    (what the state dict holds and the forward outside fp8_autocast computes in)."""

    scale_inv: torch.Tensor
    block: tuple[int, int] | None
    recipe: Recipe
    dtype: torch.dtype


def cast_parameter(weight: torch.Tensor, recipe: Recipe) -> Quantized:
    """A weight `[N, K]` for FP8-only storage: E4M3, one scale from its own amax (128x128 blocks
    under Float8BlockScaling, exact to transpose for the backward's dgrad)."""
    if recipe.float8_block_scaling():
        return quantize_blocks(weight, E4M3, (BLOCK, BLOCK), recipe.fp8_quant_fwd_weight)
    return quantize(weight, E4M3, scale_from_amax(amax(weight), float(torch.finfo(E4M3).max)))


class _InitialValue:
    """`weight.get_high_precision_init_val()` / `clear_high_precision_init_val()` (picklable)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def get(self) -> torch.Tensor | None:
        return self.value

    def clear(self) -> None:
        self.value = None


class GemmModule(ReferenceSwitch):
    """Base of the modules whose GEMMs can run in FP8 (see the module docstring). Subclasses set
    `num_gemms`, implement `_gemm_weight_names(gemm)` and call `_init_fp8()` last in their
    constructor."""

    num_gemms = 1

    def _gemm_weight_names(self, gemm: int) -> list[str]:
        """The parameters, in row order, that make up GEMM `gemm`'s weight."""
        raise NotImplementedError

    def _gemm_weight(self, gemm: int) -> torch.Tensor:
        """GEMM `gemm`'s weight `[N, K]` (one parameter, or a join of row slices)."""
        names = self._gemm_weight_names(gemm)
        return getattr(self, names[0])

    def _init_fp8(self) -> None:
        self.fp8_meta = FP8Meta(self.num_gemms)
        self._fp8_weight_cache: dict[int, tuple[tuple, WeightOperands]] = {}
        self._fp8_weights: dict[int, _FP8Weight] = {}
        if STATE.fp8_parameters:
            preserve = STATE.preserve_high_precision_init_val
            self._quantize_parameters(STATE.parameters_recipe, preserve)

    @property
    def _where(self) -> str:
        return type(self).__name__

    def _gemm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gemm: int = 0,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        """`x [..., K]` -> `[..., N]`: in FP8 inside `fp8_autocast`, else in x's dtype."""
        if not STATE.enabled:
            if STATE.calibrating:
                self._calibrate(x, weight, gemm)
            if gemm in self._fp8_weights:
                weight = self._dequantized_weight(gemm)
            return linear(x, weight, bias)
        recipe = STATE.recipe
        emulate = self.reference_active
        if not emulate:
            require_fp8_support(x.device, self._where)
        self.fp8_meta.prepare(recipe, x.device)
        step = STATE.step
        step.register(self.fp8_meta, recipe, STATE.group)
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias)
        )
        plan = GemmPlan(recipe, self.fp8_meta, gemm, emulate, activation_dtype(x), self._where)
        if grad and step.take_backward_update():
            plan.step = step
        self._plan_weight(plan, x.device, is_first_microbatch)
        return fp8_linear(x, weight, bias, plan)

    def _plan_weight(self, plan: GemmPlan, device, is_first_microbatch: bool | None) -> None:
        """Hand the plan a weight already in FP8 (FP8 parameters, or the micro-batch cache), or
        ask it to keep the one it casts (`is_first_microbatch`)."""
        gemm, key = plan.gemm, _weight_key(plan.recipe)
        stored = self._fp8_weights.get(gemm)
        if stored is not None:
            if stored.recipe.float8_block_scaling() != plan.recipe.float8_block_scaling():
                raise RuntimeError(
                    f"{self._where}: its FP8 weights were built for {type(stored.recipe).__name__}"
                    f" (fp8_model_init) and cannot run under {type(plan.recipe).__name__}"
                )
            scale_inv = stored.scale_inv.to(device)
            plan.weight = WeightOperands(
                Quantized(self._gemm_weight(gemm), scale_inv, stored.block)
            )
            return
        if is_first_microbatch is None:
            self._fp8_weight_cache.pop(gemm, None)
            return
        cached = self._fp8_weight_cache.get(gemm)
        if is_first_microbatch is False and cached is not None and cached[0] == key:
            plan.weight = cached[1]
            return
        plan.keep_weight = functools.partial(self._keep_weight, gemm, key)

    def _keep_weight(self, gemm: int, key: tuple, weight: WeightOperands) -> None:
        self._fp8_weight_cache[gemm] = (key, weight)

    def _calibrate(self, x: torch.Tensor, weight: torch.Tensor, gemm: int) -> None:
        """`calibrating=True` without FP8: record the amaxes delayed scaling will need."""
        recipe = STATE.recipe
        self.fp8_meta.prepare(recipe, x.device)
        if not recipe.delayed():
            return
        self.fp8_meta.record(gemm, "input", amax(x))
        if gemm not in self._fp8_weights:
            self.fp8_meta.record(gemm, "weight", amax(weight))
        STATE.step.register(self.fp8_meta, recipe, STATE.group, calibrating=True)

    # -- the `_extra_state` checkpoint entry --------------------------------------------------

    def get_extra_state(self) -> torch.Tensor:
        """TE's `_extra_state`: the FP8 metadata, or an empty uint8 tensor before any FP8 run."""
        return encode_extra_state(self.fp8_meta.checkpoint_state())

    def set_extra_state(self, state) -> None:
        where = f"{self._where}._extra_state"
        self.fp8_meta.load(decode_extra_state(state, where), where)

    # -- FP8-only weights (fp8_model_init) ----------------------------------------------------

    def _quantize_parameters(self, recipe: Recipe, preserve: bool = False) -> None:
        """Replace each GEMM's weight by its FP8 data (same Parameters, requires_grad=False)."""
        for gemm in range(self.num_gemms):
            params = [getattr(self, name) for name in self._gemm_weight_names(gemm)]
            with torch.no_grad():
                full = torch.cat([p.data for p in params]) if len(params) > 1 else params[0].data
                q = cast_parameter(full, recipe)
                rows = 0
                for p in params:
                    if preserve:
                        initial = _InitialValue(p.data.detach().cpu().clone())
                        p.get_high_precision_init_val = initial.get
                        p.clear_high_precision_init_val = initial.clear
                    p.data = q.data[rows : rows + p.shape[0]]
                    p.requires_grad_(False)
                    rows += p.shape[0]
            self._fp8_weights[gemm] = _FP8Weight(q.scale_inv, q.block, recipe, full.dtype)

    def _dequantized_weight(self, gemm: int) -> torch.Tensor:
        stored = self._fp8_weights[gemm]
        data = self._gemm_weight(gemm)
        q = Quantized(data, stored.scale_inv.to(data.device), stored.block)
        return dequantize(q, stored.dtype)

    def _fp8_parameter_dtypes(self) -> dict[str, torch.dtype]:
        return {
            name: getattr(self, name).dtype
            for gemm in self._fp8_weights
            for name in self._gemm_weight_names(gemm)
        }

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for gemm in self._fp8_weights:  # checkpoints hold the weights in their own dtype
            names = self._gemm_weight_names(gemm)
            rows = [getattr(self, name).shape[0] for name in names]
            for name, part in zip(names, self._dequantized_weight(gemm).split(rows)):
                destination[prefix + name] = part

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        if not self._fp8_weights:
            return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # Load into high-precision weights (any format conversion hook sees ordinary tensors),
        # then cast them to FP8 again with scales from the loaded values.
        recipes = {gemm: stored.recipe for gemm, stored in self._fp8_weights.items()}
        for gemm in recipes:
            names = self._gemm_weight_names(gemm)
            full = self._dequantized_weight(gemm)
            for name, part in zip(names, full.split([getattr(self, n).shape[0] for n in names])):
                getattr(self, name).data = part.clone()
        self._fp8_weights.clear()
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        finally:
            self._quantize_parameters(next(iter(recipes.values())))

    def _after_apply(self) -> None:
        """Hook for subclasses, run after `.to()` / `.cuda()` moved the parameters."""

    def _apply(self, fn, recurse=True):
        # `.to(dtype)` / `.half()` would cast FP8 weights as numbers, dropping their scales:
        # they travel as raw bytes (uint8 is not cast) and come back as FP8.
        dtypes = self._fp8_parameter_dtypes() if getattr(self, "_fp8_weights", None) else {}
        for name in dtypes:
            getattr(self, name).data = getattr(self, name).data.view(torch.uint8)
        try:
            result = super()._apply(fn, recurse)
            self._after_apply()
        finally:
            for name, dtype in dtypes.items():
                getattr(self, name).data = getattr(self, name).data.view(dtype)
        return result


__all__ = ["GemmModule", "cast_parameter", "linear"]
