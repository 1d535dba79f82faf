"""TransformerEngine's FP8 entry points: `autocast` (`fp8_autocast`), `quantized_model_init`
(`fp8_model_init`), `is_fp8_available`.

    with fusedlayers.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        out = layer(x)            # Linear / LayerNormLinear / LayerNormMLP GEMMs in FP8
    out.sum().backward()          # gradients in E5M2 under Format.HYBRID

Where FP8 runs: on CUDA GPUs of compute capability 8.9+ (Ada, Hopper, Blackwell) through
`torch._scaled_mm`. Everywhere else a module runs FP8 only on its reference path
(`use_reference=True` or `fusedlayers.reference_mode()`), which casts to the float8 dtypes and
back with the same scales and multiplies in fp32: the CPU tests check the recipes that way. A
module that would run FP8 GEMMs where they cannot run raises and says so (TE asserts too).

Both spellings of each context manager take TE's arguments; neither warns that the old name is
deprecated, as recent TE does.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from ..recipe import BLACKWELL_ONLY, DelayedScaling, Recipe
from ._torch_compat import HAS_FP8_DTYPES, HAS_SCALED_MM
from .state import STATE, FP8Step

logger = logging.getLogger("fusedlayers")
_warned_fp8_attention = False


@functools.cache
def _fp8_support(device_index: int | None) -> tuple[bool, str]:
    if not HAS_FP8_DTYPES or not HAS_SCALED_MM:
        return False, f"torch {torch.__version__} has no float8 dtypes or torch._scaled_mm"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is available"
    index = torch.cuda.current_device() if device_index is None else device_index
    capability = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if capability < (8, 9):
        return False, f"{name} has compute capability {capability[0]}.{capability[1]}"
    if capability < (9, 0) and float(torch.version.cuda or 0) < 12.1:
        return False, f"FP8 on Ada (sm_89) needs CUDA 12.1 or newer, torch has {torch.version.cuda}"
    return True, ""


def check_fp8_support(device: torch.device | int | None = None) -> tuple[bool, str]:
    """(available, reason): whether FP8 GEMMs can run on `device` (default: the current CUDA
    device). They need the float8 dtypes and `torch._scaled_mm`, and a CUDA GPU of compute
    capability 8.9 or newer; `reason` says what is missing ("" when available)."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return False, f"tensors on {device} (FP8 GEMMs need a CUDA GPU)"
        device = device.index
    return _fp8_support(device)


def is_fp8_available(return_reason: bool = False):
    """Whether FP8 GEMMs (delayed and current scaling) can run on the current CUDA device: a
    bool, or `(bool, reason)` with `return_reason=True` (TE's signature)."""
    available = check_fp8_support()
    return available if return_reason else available[0]


def require_fp8_support(device: torch.device, where: str) -> None:
    """Raise, naming `where`, when FP8 GEMMs cannot run on `device`; point at the emulation."""
    ok, reason = check_fp8_support(device)
    if not ok:
        raise RuntimeError(
            f"{where}: FP8 GEMMs inside fp8_autocast(enabled=True) need a CUDA GPU of compute "
            f"capability 8.9 or newer (Ada, Hopper, Blackwell) and torch._scaled_mm; here: "
            f"{reason}. To emulate FP8 in PyTorch on any device (same scales, casts to the "
            "float8 dtypes and back), set use_reference=True on the model or run inside "
            "fusedlayers.reference_mode()"
        )


def check_recipe(recipe, enabled: bool, name: str = "recipe") -> Recipe:
    """The recipe an autocast block runs: TE's default (`DelayedScaling()`) for None; a clear
    error for a non-recipe, and for the Blackwell-only recipes when FP8 is enabled."""
    if recipe is None:
        return DelayedScaling()
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"{name} ({recipe!r}) must be a recipe from fusedlayers.recipe (DelayedScaling, "
            "Float8CurrentScaling, Float8BlockScaling)"
        )
    if enabled and isinstance(recipe, BLACKWELL_ONLY):
        here = (
            torch.cuda.get_device_name()
            if torch.cuda.is_available()
            else "this machine has no CUDA GPU"
        )
        raise RuntimeError(
            f"{type(recipe).__name__} needs a Blackwell GPU (compute capability 10.0, sm_100) "
            f"and is not implemented in fusedlayers ({here}); on Hopper (sm_90) and Ada (sm_89) "
            "use DelayedScaling, Float8CurrentScaling or Float8BlockScaling"
        )
    if enabled and (recipe.fp8_dpa or recipe.fp8_mha):
        _warn_fp8_attention_once()
    return recipe


def _warn_fp8_attention_once() -> None:
    global _warned_fp8_attention
    if not _warned_fp8_attention:
        _warned_fp8_attention = True
        logger.warning(
            "fusedlayers: fp8_dpa/fp8_mha are set, but FP8 attention is not implemented yet: "
            "DotProductAttention runs in the activation dtype; the projections run in FP8"
        )


@contextlib.contextmanager
def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Recipe | None = None,
    amax_reduction_group=None,
):
    """Run the GEMMs of fusedlayers' Linear, LayerNormLinear and LayerNormMLP (and of the
    modules built from them) in FP8 inside the block, as TE's `autocast`.

    enabled: FP8 GEMMs on. calibrating: record amaxes (delayed scaling) while computing in high
    precision, so a checkpoint gets scales for FP8 inference; the scales are updated at the
    block's exit. recipe: default `DelayedScaling()`. amax_reduction_group: the
    torch.distributed group the amaxes are all-reduced over (None: the default group when
    torch.distributed is initialized), so every rank keeps the same scales.

    Blocks nest; the outermost exit updates the forward scales (TE's rule: only when autograd
    is recording, or after a calibrating block). FP8 shapes: every GEMM's K and N (input and
    output features) must be multiples of 16, and the token count too when the weight gradient
    is computed; other shapes raise `ArgumentError`.
    """
    recipe = check_recipe(recipe, enabled)
    saved = (STATE.enabled, STATE.calibrating, STATE.recipe, STATE.group)
    STATE.enabled, STATE.calibrating = bool(enabled), bool(calibrating)
    STATE.recipe, STATE.group = recipe, amax_reduction_group
    if STATE.depth == 0:
        STATE.step = FP8Step()
    STATE.depth += 1
    try:
        yield
    finally:
        STATE.enabled, STATE.calibrating, STATE.recipe, STATE.group = saved
        STATE.depth -= 1
        if STATE.depth == 0:
            step, STATE.step = STATE.step, None
            if torch.is_grad_enabled() or step.calibrated:
                step.update_forward()


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group=None,
):
    """TE's older name for `autocast`, with its argument names (`fp8_recipe`, `fp8_group`)."""
    return autocast(enabled, calibrating, fp8_recipe, fp8_group)


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
):
    """Modules built inside keep their GEMM weights in FP8 only (TE's `quantized_model_init`),
    for inference memory: E4M3 with one scale per weight from its own amax (128x128 blocks under
    Float8BlockScaling), requires_grad=False (they do not train here). The state dict holds them
    dequantized in the dtype they were built in, and loading one quantizes again.
    `preserve_high_precision_init_val` keeps a CPU copy of the initial values on each weight,
    read by `weight.get_high_precision_init_val()` and freed by
    `weight.clear_high_precision_init_val()`."""
    recipe = check_recipe(recipe, enabled)
    saved = (STATE.fp8_parameters, STATE.parameters_recipe, STATE.preserve_high_precision_init_val)
    STATE.fp8_parameters, STATE.parameters_recipe = bool(enabled), recipe
    STATE.preserve_high_precision_init_val = bool(preserve_high_precision_init_val)
    try:
        yield
    finally:
        (
            STATE.fp8_parameters,
            STATE.parameters_recipe,
            STATE.preserve_high_precision_init_val,
        ) = saved


def fp8_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
):
    """TE's older name for `quantized_model_init`."""
    return quantized_model_init(enabled, recipe, preserve_high_precision_init_val)


__all__ = [
    "autocast",
    "check_fp8_support",
    "fp8_autocast",
    "fp8_model_init",
    "is_fp8_available",
    "quantized_model_init",
]
