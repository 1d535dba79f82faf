"""What `fp8_autocast` and `fp8_model_init` set, and the end-of-step scale updates.

One process-wide `STATE`, as TransformerEngine keeps one: the backward runs on autograd's own
threads, so nothing the backward needs is read from it (the GEMMs carry their recipe and metadata
in their autograd context). `fp8_autocast` blocks nest; each restores what it found.

A *step* is one outermost `fp8_autocast` block. The modules whose GEMMs run inside it register
their `FP8Meta`; at the block's exit the forward tensors' delayed scales are updated (amaxes
all-reduced over the group first), and the backward tensors' at the end of the backward of the
first GEMM that ran in the block, which is the last backward to run in a sequential model (TE's
rule too). Current and block scaling register nothing: their scales come from each cast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..recipe import Recipe
from .meta import FP8Meta


@dataclass
class _Registration:
    meta: FP8Meta
    recipe: Recipe
    group: object


@dataclass
class FP8Step:
    """The delayed-scaling metadata used inside one outermost `fp8_autocast` block."""

    metas: dict[int, _Registration] = field(default_factory=dict)
    calibrated: bool = False  # amaxes were recorded by a calibrating block
    backward_owner_taken: bool = False
    backward_updated: bool = False

    def register(self, meta: FP8Meta, recipe: Recipe, group, calibrating: bool = False) -> None:
        if recipe.delayed():
            self.metas.setdefault(id(meta), _Registration(meta, recipe, group))
            self.calibrated |= calibrating

    def take_backward_update(self) -> bool:
        """True for the first GEMM that asks: its backward runs `update_backward`."""
        taken, self.backward_owner_taken = self.backward_owner_taken, True
        return not taken

    def update_forward(self) -> None:
        _update(list(self.metas.values()), backward=False)

    def update_backward(self) -> None:
        if not self.backward_updated:
            self.backward_updated = True
            _update(list(self.metas.values()), backward=True)


def _reduce_amaxes(registrations: list[_Registration], backward: bool) -> None:
    """All-reduce (MAX) this step's amax rows over each group, one collective per group, when
    the recipe asks (`reduce_amax`) and torch.distributed runs with more than one rank in it;
    group None is the default (world) group, as in TE."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    by_group: dict[int, list[_Registration]] = {}
    for reg in registrations:
        if reg.recipe.reduce_amax and dist.get_world_size(reg.group) > 1:
            by_group.setdefault(id(reg.group), []).append(reg)
    for regs in by_group.values():
        rows = [reg.meta.history(backward)[0] for reg in regs]
        flat = torch.cat(rows)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=regs[0].group)
        with torch.no_grad():
            for row, reduced in zip(rows, flat.split([r.numel() for r in rows])):
                row.copy_(reduced)


def _update(registrations: list[_Registration], backward: bool) -> None:
    if not registrations:
        return
    _reduce_amaxes(registrations, backward)
    for reg in registrations:
        reg.meta.update(backward, reg.recipe)


@dataclass
class AutocastState:
    """The innermost `fp8_autocast` block's arguments, and the step of the outermost one."""

    enabled: bool = False
    calibrating: bool = False
    recipe: Recipe | None = None
    group: object = None
    depth: int = 0
    step: FP8Step | None = None
    # fp8_model_init / quantized_model_init
    fp8_parameters: bool = False
    parameters_recipe: Recipe | None = None
    preserve_high_precision_init_val: bool = False


STATE = AutocastState()


def fp8_active() -> bool:
    """Inside an `fp8_autocast` block that runs GEMMs in FP8 or records amaxes."""
    return STATE.enabled or STATE.calibrating


__all__ = ["STATE", "AutocastState", "FP8Step", "fp8_active"]
