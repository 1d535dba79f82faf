"""The `_extra_state` checkpoint entry: FP8 metadata in TransformerEngine's layout, read safely.

TE (2.x) saves each module's FP8 metadata as a uint8 tensor holding a pickled dict:

    {"recipe": <recipe object>, "scale_fwd": [3 * gemms], "amax_history_fwd": [L, 3 * gemms],
     "scale_bwd": [2 * gemms], "amax_history_bwd": [L, 2 * gemms],
     "extra_fp8_variables": {"num_gemms": ..., ...}}

(the four tensors for delayed scaling only), and an empty uint8 tensor for a module that never
ran in FP8. TE 1.x wrote `torch.save` payloads (a `BytesIO` or its bytes as a uint8 tensor), with
`None` for no FP8 state. `encode_extra_state` writes the 2.x layout; `decode_extra_state` reads
every one of them.

Pickles are never executed as they stand: the unpickler below builds only tensors (through
`torch.load(weights_only=True)`), containers and the recipe classes, and maps TE's recipe classes
(`transformer_engine.common.recipe.*`) onto `fusedlayers.recipe`'s, so a TE checkpoint loads
without TE installed. Anything else raises `ValueError` naming the entry.
"""

from __future__ import annotations

import collections
import io
import pickle

import torch
import torch._utils

from .. import recipe as recipe_module

_RECIPE_MODULES = ("transformer_engine.common.recipe", "fusedlayers.recipe")
_RECIPE_NAMES = (
    "Format",
    "_FormatHelper",
    "QParams",
    "MMParams",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
)


def _load_storage(data: bytes):
    """What pickle calls to rebuild a tensor's storage, with torch's safe loader."""
    return torch.load(io.BytesIO(data), weights_only=True)


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only tensors, torch dtypes, OrderedDict and the recipe classes."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module in _RECIPE_MODULES and name in _RECIPE_NAMES:
            return getattr(recipe_module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in an FP8 extra state")


def _payload_bytes(state, where: str) -> bytes | None:
    if isinstance(state, io.BytesIO):
        return state.getvalue()
    if isinstance(state, torch.Tensor):
        if state.numel() == 0:
            return None
        return state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    raise ValueError(f"{where}: unsupported extra state of type {type(state).__name__}")


def decode_extra_state(state, where: str = "_extra_state") -> dict | None:
    """A checkpoint's `_extra_state` entry -> the FP8 metadata dict, or None when it has none.

    Accepts None, an empty uint8 tensor, a uint8 tensor or `BytesIO` holding a pickle or a
    `torch.save` payload of None or of a dict. Raises ValueError (naming `where`) otherwise."""
    if state is None:
        return None
    data = _payload_bytes(state, where)
    if not data:
        return None
    try:
        if data.startswith(b"PK"):  # torch.save's zip container (TE 1.x)
            decoded = torch.load(io.BytesIO(data), weights_only=True)
        else:
            decoded = _RestrictedUnpickler(io.BytesIO(data)).load()
    except Exception as error:
        raise ValueError(
            f"{where}: cannot read this extra state ({len(data)} bytes) as FP8 metadata: {error}"
        ) from error
    if decoded is not None and not isinstance(decoded, dict):
        raise ValueError(
            f"{where}: extra state holds a {type(decoded).__name__}, expected FP8 metadata (a "
            "dict) or None"
        )
    return decoded


def encode_extra_state(state: dict | None) -> torch.Tensor:
    """FP8 metadata (tensors on the CPU, a recipe, plain values) -> the uint8 tensor TE's layout
    stores; None -> the empty tensor TE saves for a module without FP8 state. A recipe that
    cannot be pickled (a lambda in `amax_compute_algo`) is saved as None: the tensors matter,
    and the recipe in force at the next `fp8_autocast` governs anyway."""
    if state is None:
        return torch.empty(0, dtype=torch.uint8)
    try:
        data = pickle.dumps(state)
    except (pickle.PicklingError, AttributeError, TypeError):
        data = pickle.dumps({**state, "recipe": None})
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


__all__ = ["decode_extra_state", "encode_extra_state"]
