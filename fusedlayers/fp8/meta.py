"""A module's FP8 metadata: TE's per-tensor scales and amax histories, and their checkpoint form.

Layout (TransformerEngine's, so checkpoints move between the two): a module with `n` GEMMs
keeps, for delayed scaling,

    scale_fwd [3n]             per GEMM g: slot 3g input, 3g + 1 weight, 3g + 2 output
    amax_history_fwd [L, 3n]   L = the recipe's amax_history_len; row 0 is the step in progress
    scale_bwd [2n]             per GEMM g: slot 2g grad_output, 2g + 1 grad_input
    amax_history_bwd [L, 2n]

The output and grad_input slots are kept for the layout and stay at scale 1 (no GEMM here writes
FP8 outputs). Current and block scaling keep no tensors: only the recipe is remembered, for the
checkpoint. Scales start at 1 and histories at 0, as in TE.
"""

from __future__ import annotations

import torch

from ..recipe import DelayedScaling, Recipe
from .scaling import delayed_update, fp8_dtype, fp8_max

_FWD_ROLES = {"input": 0, "weight": 1, "output": 2}
_BWD_ROLES = {"grad_output": 0, "grad_input": 1}
_TENSORS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


def slot(gemm: int, role: str) -> tuple[bool, int]:
    """(backward?, column) of `role` of GEMM `gemm` in TE's layout."""
    if role in _FWD_ROLES:
        return False, 3 * gemm + _FWD_ROLES[role]
    return True, 2 * gemm + _BWD_ROLES[role]


class FP8Meta:
    """Scales and amax histories of one module's `num_gemms` GEMMs (see the module docstring)."""

    def __init__(self, num_gemms: int) -> None:
        self.num_gemms = num_gemms
        self.recipe: Recipe | None = None  # the recipe of the last FP8 (or calibration) forward
        self.scale_fwd = self.amax_history_fwd = None
        self.scale_bwd = self.amax_history_bwd = None

    def prepare(self, recipe: Recipe, device: torch.device) -> None:
        """Before a forward under `recipe`: delayed-scaling tensors on `device`, created (or
        reset when the history length changed, as a fresh window) on first use."""
        self.recipe = recipe
        if not recipe.delayed():
            return
        length, n = recipe.amax_history_len, self.num_gemms
        if self.amax_history_fwd is None or self.amax_history_fwd.shape[0] != length:
            self.scale_fwd = torch.ones(3 * n, dtype=torch.float32, device=device)
            self.amax_history_fwd = torch.zeros(length, 3 * n, dtype=torch.float32, device=device)
            self.scale_bwd = torch.ones(2 * n, dtype=torch.float32, device=device)
            self.amax_history_bwd = torch.zeros(length, 2 * n, dtype=torch.float32, device=device)
        elif self.scale_fwd.device != device:  # loaded on the CPU, or the module moved
            for name in _TENSORS:
                setattr(self, name, getattr(self, name).to(device))

    def history(self, backward: bool) -> torch.Tensor:
        return self.amax_history_bwd if backward else self.amax_history_fwd

    def scales(self, backward: bool) -> torch.Tensor:
        return self.scale_bwd if backward else self.scale_fwd

    def scale(self, gemm: int, role: str) -> torch.Tensor:
        """The 0-d scale this step casts `role` of GEMM `gemm` with."""
        backward, column = slot(gemm, role)
        return self.scales(backward)[column]

    @torch.no_grad()
    def record(self, gemm: int, role: str, a: torch.Tensor) -> None:
        """Fold amax `a` into this step's row (max with what an earlier call recorded)."""
        backward, column = slot(gemm, role)
        row = self.history(backward)[0]
        row[column] = torch.maximum(row[column], a.to(row.device))

    @torch.no_grad()
    def update(self, backward: bool, recipe: Recipe) -> None:
        """End of a step for the forward or backward tensors: `delayed_update` with the format's
        FP8 maximum."""
        max_value = fp8_max(fp8_dtype(recipe.fp8_format, backward))
        delayed_update(self.history(backward), self.scales(backward), max_value, recipe)

    def checkpoint_state(self) -> dict | None:
        """TE's `_extra_state` dict (CPU tensors), or None before any FP8 forward."""
        if self.recipe is None:
            return None
        state = {"recipe": self.recipe}
        if self.amax_history_fwd is not None and self.recipe.delayed():
            for name in _TENSORS:
                state[name] = getattr(self, name).detach().cpu().clone()
        fmt = self.recipe.fp8_format.value
        state["extra_fp8_variables"] = {
            "num_gemms": self.num_gemms,
            "fp8_checkpoint": True,
            "fp8_max_fwd": fmt.max_fwd,
            "fp8_max_bwd": fmt.max_bwd,
        }
        return state

    def load(self, state: dict | None, where: str) -> None:
        """Take a decoded `_extra_state` (None: nothing to load). Shapes must match this
        module's GEMM count; the tensors stay where they are until the next FP8 forward moves
        them to the input's device."""
        if state is None:
            return
        recipe = state.get("recipe")
        if recipe is not None and not isinstance(recipe, Recipe):
            raise ValueError(f"{where}: 'recipe' holds a {type(recipe).__name__}, not a recipe")
        if "scale_fwd" not in state:  # current or block scaling: nothing but the recipe
            self.recipe = recipe
            return
        expected = {
            "scale_fwd": (3 * self.num_gemms,),
            "scale_bwd": (2 * self.num_gemms,),
            "amax_history_fwd": (None, 3 * self.num_gemms),
            "amax_history_bwd": (None, 2 * self.num_gemms),
        }
        tensors = {}
        for name, shape in expected.items():
            value = state.get(name)
            if not isinstance(value, torch.Tensor) or value.dim() != len(shape):
                raise ValueError(f"{where}: {name} is missing or not a {len(shape)}-d tensor")
            if any(want is not None and got != want for got, want in zip(value.shape, shape)):
                raise ValueError(
                    f"{where}: {name} has shape {tuple(value.shape)}, this module's "
                    f"{self.num_gemms} GEMM(s) need {tuple(s or 'L' for s in shape)}"
                )
            tensors[name] = value.detach().float().clone()
        if tensors["amax_history_fwd"].shape[0] != tensors["amax_history_bwd"].shape[0]:
            raise ValueError(f"{where}: amax_history_fwd and amax_history_bwd differ in length")
        for name, value in tensors.items():
            setattr(self, name, value)
        # TE 1.x checkpoints carry no recipe; their tensors are delayed scaling's.
        self.recipe = recipe if recipe is not None else _default_delayed(tensors)


def _default_delayed(tensors: dict) -> Recipe:
    return DelayedScaling(amax_history_len=tensors["amax_history_fwd"].shape[0])


__all__ = ["FP8Meta", "slot"]
