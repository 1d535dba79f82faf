"""GPT checkpoints in safetensors: nothing is ever unpickled.

Two files per checkpoint (a path given without the `.safetensors` suffix gets it, on saving and
on loading alike):
    `<name>.safetensors`        model weights; metadata: format tag, `GPTConfig` as JSON, a sha256
                                over every tensor's bytes (safetensors itself checks the header and
                                sizes but not the data, so a flipped bit would load silently).
    `<name>.train.safetensors`  optional resume state: optimizer tensors, param-group settings and
                                step as JSON, RNG states, caller's extra JSON, and the sha256 of the
                                weights file it belongs to (so a stale pair is caught).

Every failure raises `CheckpointError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import GPTConfig

FORMAT = "fusedlayers-gpt"
FORMAT_VERSION = "1"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded: unreadable, corrupted or mismatched."""


def weights_path(path: str | Path) -> Path:
    """The weights file a checkpoint `path` names: `path` itself when it ends in `.safetensors`,
    else `path` with the suffix appended (`run/ck` -> `run/ck.safetensors`, `ck.v2` ->
    `ck.v2.safetensors`)."""
    path = Path(path)
    if path.name.endswith(".safetensors"):
        return path
    return path.with_name(path.name + ".safetensors")


def _existing_weights(path: str | Path) -> Path:
    """`weights_path(path)`, or `path` as given when only that file exists (written before the
    suffix was added)."""
    named = weights_path(path)
    return Path(path) if not named.is_file() and Path(path).is_file() else named


def train_state_path(path: str | Path) -> Path:
    """The companion resume-state file of the weights file `path` (with or without its
    `.safetensors` suffix: `ck` and `ck.safetensors` both give `ck.train.safetensors`)."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".safetensors") + ".train.safetensors")


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write tensors + metadata atomically; returns the tensors' sha256."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    digest = _digest(tensors)
    metadata = {**metadata, "sha256": digest}
    # Write then rename, so an interrupted save never leaves a half-written file under the name.
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)
    return digest


def _read(path: Path, expected_kind: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the metadata of a checkpoint file, after checking tag and checksum."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated?): {e}") from e
    kind = metadata.get("format")
    if kind != expected_kind:
        raise CheckpointError(f"{path}: format tag is {kind!r}, expected {expected_kind!r}")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {metadata.get('format_version')!r}, "
            f"this code reads {FORMAT_VERSION!r}"
        )
    if metadata.get("sha256") != _digest(tensors):
        raise CheckpointError(f"{path}: tensor data does not match its sha256 (corrupted file)")
    return tensors, metadata


def _json(path: Path, metadata: dict[str, str], key: str) -> Any:
    try:
        return json.loads(metadata[key])
    except (KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: metadata {key!r} is missing or not JSON: {e}") from e


def read_config(path: str | Path) -> GPTConfig:
    """The `GPTConfig` stored in a weights file (the file is fully verified first)."""
    path = _existing_weights(path)
    _, metadata = _read(path, FORMAT)
    return _config_from(path, metadata)


def _config_from(path: Path, metadata: dict[str, str]) -> GPTConfig:
    try:
        return GPTConfig.from_dict(_json(path, metadata, "config"))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: stored config is invalid: {e}") from e


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    *,
    weights: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> Path:
    """Write `model` (a `GPT`, or a DDP/compiled wrapper of one) to `path` (`.safetensors`
    appended when it does not end so, see `weights_path`); with an optimizer, also the resume
    state to `train_state_path(path)`. Returns the weights file's path.

    `weights` and `optimizer_state` (torch's `optimizer.state_dict()` form) replace the model's
    and optimizer's own state when given: a sharded model passes its gathered full state
    (`sharded_checkpoint`), so every checkpoint has one format whatever wrote it."""
    path = weights_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    gpt = _unwrap(model)
    weights = gpt.state_dict() if weights is None else weights
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION}
    weights_sha = _write(path, weights, {**meta, "config": json.dumps(gpt.config.to_dict())})
    if optimizer is not None or optimizer_state is not None:
        state = optimizer.state_dict() if optimizer_state is None else optimizer_state
        tensors, state_meta = _optimizer_to_flat(state)
        tensors["rng.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            tensors["rng.cuda"] = torch.cuda.get_rng_state()
        state_meta.update(
            step=json.dumps(step),
            extra=json.dumps(extra or {}),
            weights_sha256=weights_sha,
        )
        _write(train_state_path(path), tensors, {**meta, **state_meta, "format": FORMAT + "-train"})
    return path


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT inside DDP (`.module`) or torch.compile (`._orig_mod`) wrappers."""
    while not hasattr(model, "config"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load a weights file into `model`, checking config, key set and every shape first."""
    tensors = checked_weights(path, model)
    _unwrap(model).load_state_dict(tensors)


def checked_weights(path: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full tensors of a weights file, checked against `model`'s config, keys and shapes
    (a sharded model's state dict reports full shapes, so it is checked the same way)."""
    path = _existing_weights(path)
    tensors, metadata = _read(path, FORMAT)
    gpt = _unwrap(model)
    stored = _config_from(path, metadata).to_dict()
    expected = gpt.config.to_dict()
    diffs = [
        f"{k}: file {stored[k]!r} vs model {expected[k]!r}"
        for k in expected
        if stored.get(k) != expected[k]
    ]
    if diffs:
        raise CheckpointError(f"{path}: config mismatch: " + "; ".join(diffs))
    own = gpt.state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing keys {missing}, unexpected keys {unexpected}")
    bad = [
        f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(v.shape)}"
        for k, v in own.items()
        # `_extra_state` entries are serialized FP8 metadata: their length is their content's.
        if tensors[k].shape != v.shape and not k.endswith("_extra_state")
    ]
    if bad:
        raise CheckpointError(f"{path}: shape mismatch: " + "; ".join(bad))
    return tensors


def load_train_state(
    path: str | Path, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore the optimizer and RNG state saved next to weights file `path` (load the weights
    first). Returns `{"step": int | None, "extra": dict}`."""
    return restore_train_state(path, optimizer, lambda state: optimizer.load_state_dict(state))


def restore_train_state(path: str | Path, optimizer, load) -> dict[str, Any]:
    """`load_train_state` with the loading step left to the caller: `load(state)` receives the
    checked optimizer state in `optimizer.state_dict()` form (a sharded optimizer loads it its
    own way)."""
    path = _existing_weights(path)
    state_path = train_state_path(path)
    tensors, metadata = _read(state_path, FORMAT + "-train")
    weights_sha = _read(path, FORMAT)[1]["sha256"]
    if metadata.get("weights_sha256") != weights_sha:
        raise CheckpointError(f"{state_path}: belongs to different weights than {path}")
    if optimizer is not None:
        state = _optimizer_from_flat(state_path, optimizer, tensors, metadata)
        try:
            load(state)
        except (ValueError, RuntimeError, KeyError) as e:
            raise CheckpointError(
                f"{state_path}: optimizer state does not fit this optimizer: {e}"
            ) from e
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return {
        "step": _json(state_path, metadata, "step"),
        "extra": _json(state_path, metadata, "extra"),
    }


def _optimizer_to_flat(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state (`state_dict()` form) as `state.<param index>.<key>` tensors plus JSON
    param groups. Non-tensor per-parameter values (rare) go to JSON too."""
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = value
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {
        "param_groups": json.dumps(sd["param_groups"]),
        "state_scalars": json.dumps(scalars),
    }


def _optimizer_from_flat(
    path: Path, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], metadata: dict
) -> dict[str, Any]:
    """The checked optimizer state in `state_dict()` form."""
    groups = _json(path, metadata, "param_groups")
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
        raise CheckpointError(
            f"{path}: optimizer has param groups of sizes "
            f"{[len(g['params']) for g in opt.param_groups]}, file has "
            f"{[len(g['params']) for g in groups]}"
        )
    params = [p for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("state."):
            _, idx, key = name.split(".", 2)
            # Optimizer.load_state_dict does not check shapes; a moment of the wrong shape
            # would only fail (or broadcast) at the next step.
            if int(idx) >= len(params) or value.dim() and value.shape != params[int(idx)].shape:
                raise CheckpointError(
                    f"{path}: optimizer state {name} has shape {tuple(value.shape)}, which fits "
                    "no parameter of this optimizer at that index"
                )
            state.setdefault(int(idx), {})[key] = value
    for name, value in _json(path, metadata, "state_scalars").items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    return {"state": state, "param_groups": groups}
