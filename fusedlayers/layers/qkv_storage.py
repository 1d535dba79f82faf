"""The three ways TransformerEngine stores QKV projection weights, and conversions between them.

With `h` query heads, `g` KV groups (`h % g == 0`), head size `d` and `hidden` input features, the
self-attention projection has `(h + 2g) * d` output rows, stored as one of:

- `separate` (`fuse_qkv_params=False`): `query_weight [h*d, hidden]`, `key_weight [g*d, hidden]`,
  `value_weight [g*d, hidden]` (+ `*_bias`), row-slices of one buffer;
- `interleaved` (`fuse_qkv_params=True, qkv_weight_interleaved=True`): `weight` whose rows are
  grouped per KV group: `[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]`, i.e.
  a `[g, h/g + 2, d, hidden]` view;
- `concat` (`fuse_qkv_params=True, qkv_weight_interleaved=False`): `weight` laid out
  `[all q | all k | all v]`.

Cross-attention's `key_value` projection is the same with names `(key, value)` (interleaved:
`[k_0, v_0, k_1, v_1, ...]`), and its query projection with `(query,)` only changes the name
(`query_weight` vs `weight`). Query head `i` belongs to KV group `i // (h/g)` in every form.

A module built with one form loads a state dict saved with another: a load pre-hook converts the
incoming keys. Separate vs fused is told by the key names; which fused layout a `weight` has is
recorded in the state dict's per-module metadata (`_metadata[prefix]["qkv_storage"]`, kept by
`torch.save`). Without that record (TE checkpoints, safetensors) a fused `weight` is taken to be in
the target's own fused layout, as TE does, or TE's default `interleaved` when the target is
`separate`; `convert_qkv_state_dict` converts explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMS = ("separate", "interleaved", "concat")
_METADATA_KEY = "qkv_storage"


def storage_form(fuse_qkv_params: bool, qkv_weight_interleaved: bool) -> str:
    """TE's two flags -> `separate`, `interleaved` or `concat`."""
    if not fuse_qkv_params:
        return "separate"
    return "interleaved" if qkv_weight_interleaved else "concat"


@dataclass(frozen=True)
class QKVSpec:
    """Which projections share the weight: `names`, heads per name, KV groups, head size."""

    names: tuple[str, ...]
    heads: tuple[int, ...]
    groups: int
    head_dim: int

    def __post_init__(self) -> None:
        for name, heads in zip(self.names, self.heads):
            if heads % self.groups:
                raise ValueError(f"{name} heads ({heads}) not divisible by groups ({self.groups})")

    @property
    def rows(self) -> list[int]:
        return [heads * self.head_dim for heads in self.heads]


def split_fused(t: torch.Tensor, spec: QKVSpec, form: str) -> list[torch.Tensor]:
    """Fused `[rows, *rest]` -> one tensor per name, `[heads_i * d, *rest]`, heads in order."""
    if form == "concat" or len(spec.names) == 1:
        return list(t.split(spec.rows, dim=0))
    if form != "interleaved":
        raise ValueError(f"not a fused form: {form!r}")
    per_group = [heads // spec.groups for heads in spec.heads]
    grouped = t.reshape(spec.groups, sum(per_group), spec.head_dim, *t.shape[1:])
    return [
        part.reshape(heads * spec.head_dim, *t.shape[1:])
        for part, heads in zip(grouped.split(per_group, dim=1), spec.heads)
    ]


def join_fused(parts: list[torch.Tensor], spec: QKVSpec, form: str) -> torch.Tensor:
    """Inverse of `split_fused`: per-name tensors -> one fused `[rows, *rest]` tensor."""
    if form == "concat" or len(spec.names) == 1:
        return torch.cat(parts, dim=0)
    if form != "interleaved":
        raise ValueError(f"not a fused form: {form!r}")
    rest = parts[0].shape[1:]
    grouped = [
        p.reshape(spec.groups, heads // spec.groups, spec.head_dim, *rest)
        for p, heads in zip(parts, spec.heads)
    ]
    return torch.cat(grouped, dim=1).reshape(sum(spec.rows), *rest)


def _keys(prefix: str, spec: QKVSpec, form: str, kind: str) -> list[str]:
    if form == "separate":
        return [f"{prefix}{name}_{kind}" for name in spec.names]
    return [f"{prefix}{kind}"]


def detect_form(state_dict, prefix: str, spec: QKVSpec, recorded: str | None, fallback: str):
    """The storage form of `prefix`'s weights in `state_dict`, None when they are absent.

    `recorded` is the form saved in the module's metadata, if any; `fallback` is assumed for a
    fused `weight` without a record.
    """
    if all(key in state_dict for key in _keys(prefix, spec, "separate", "weight")):
        return "separate"
    if f"{prefix}weight" in state_dict:
        return recorded or fallback
    return None


def convert_qkv_state_dict(state_dict, prefix: str, spec: QKVSpec, src: str, dst: str) -> None:
    """Rewrite `prefix`'s QKV weights (and biases) in `state_dict` from form `src` to `dst`,
    in place."""
    if src == dst:
        return
    for kind in ("weight", "bias"):
        src_keys = _keys(prefix, spec, src, kind)
        if not all(key in state_dict for key in src_keys):
            continue
        tensors = [state_dict.pop(key) for key in src_keys]
        parts = tensors if src == "separate" else split_fused(tensors[0], spec, src)
        if dst == "separate":
            for key, part in zip(_keys(prefix, spec, dst, kind), parts):
                state_dict[key] = part
        else:
            state_dict[f"{prefix}{kind}"] = join_fused(parts, spec, dst)


class _RecordForm:
    """State-dict post-hook: note the storage form in the module's metadata. (Hooks are
    callable objects rather than closures so that modules stay picklable.)"""

    def __init__(self, form: str) -> None:
        self.form = form

    def __call__(self, _module, _state_dict, _prefix, local_metadata) -> None:
        local_metadata[_METADATA_KEY] = self.form


class _ConvertForm:
    """Load pre-hook: rewrite incoming QKV weights from their form into the module's."""

    def __init__(self, spec: QKVSpec, form: str) -> None:
        self.spec = spec
        self.form = form
        self.fallback = "interleaved" if form == "separate" else form

    def __call__(self, _module, state_dict, prefix, local_metadata, *_args) -> None:
        recorded = local_metadata.get(_METADATA_KEY)
        src = detect_form(state_dict, prefix, self.spec, recorded, self.fallback)
        if src is not None:
            convert_qkv_state_dict(state_dict, prefix, self.spec, src, self.form)


def install_qkv_storage_hooks(module: torch.nn.Module, spec: QKVSpec, form: str) -> None:
    """Make `module` (a Linear / LayerNormLinear holding QKV rows in `form`) record its form when
    saved and convert any other form when loaded."""
    if form not in FORMS:
        raise ValueError(f"form ({form!r}) must be one of {FORMS}")
    module.register_state_dict_post_hook(_RecordForm(form))
    module.register_load_state_dict_pre_hook(_ConvertForm(spec, form))


__all__ = [
    "FORMS",
    "QKVSpec",
    "convert_qkv_state_dict",
    "install_qkv_storage_hooks",
    "join_fused",
    "split_fused",
    "storage_form",
]
