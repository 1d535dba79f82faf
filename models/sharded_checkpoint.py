"""Checkpoints of an FSDP2-sharded GPT in the one safetensors format of `checkpoint`.

Saving gathers the full weights and optimizer state to rank 0 (torch.distributed.checkpoint's
full-state-dict API, offloaded to the CPU) and writes them with `save_checkpoint`, so the files
are the ones an unsharded run writes: either kind of run resumes from either kind of file.
Loading reads the full tensors on every rank, checks them as `load_weights` does, and lets each
rank keep its shard. The optimizer state is stored by parameter index (torch's
`optimizer.state_dict()` form); the sharded API names parameters by their module path, so the
two are mapped through the optimizer's parameter order.

Every rank calls both functions (they are collectives).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .checkpoint import checked_weights, restore_train_state, save_checkpoint

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The module path of every parameter the optimizer holds, in its order (index i of
    `optimizer.state_dict()` is names[i])."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _rekey(state: dict[str, Any], mapping: dict) -> dict[str, Any]:
    """The same optimizer state with every parameter key `k` replaced by `mapping[k]`."""
    return {
        "state": {mapping[k]: v for k, v in state["state"].items()},
        "param_groups": [
            {**group, "params": [mapping[k] for k in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def save_sharded_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Gather `model` (FSDP2-sharded GPT) and `optimizer` to rank 0, which writes `path` (and
    the resume state) exactly as `save_checkpoint` does. Returns the weights path."""
    weights = get_model_state_dict(model, options=_FULL)
    state = None
    if optimizer is not None:
        by_name = get_optimizer_state_dict(model, optimizer, options=_FULL)
        if dist.get_rank() == 0:  # the others hold nothing: the state went to rank 0's CPU
            names = _parameter_names(model, optimizer)
            state = _rekey(by_name, {name: i for i, name in enumerate(names)})
    if dist.get_rank() == 0:
        save_checkpoint(path, model, None, step, extra, weights=weights, optimizer_state=state)
    dist.barrier()  # no rank reads the files before they are complete
    return Path(path)


def load_sharded_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint (from a sharded or an unsharded run) into the sharded `model` and
    `optimizer`. Returns `{"step", "extra"}` like `load_train_state`."""
    set_model_state_dict(
        model, checked_weights(path, model), options=StateDictOptions(full_state_dict=True)
    )
    if optimizer is None:
        return restore_train_state(path, None, None)
    names = dict(enumerate(_parameter_names(model, optimizer)))

    def load(state: dict[str, Any]) -> None:
        set_optimizer_state_dict(
            model,
            optimizer,
            _rekey(state, names),
            options=StateDictOptions(full_state_dict=True),
        )

    return restore_train_state(path, optimizer, load)
