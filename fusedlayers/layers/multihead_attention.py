"""`MultiheadAttention`: TransformerEngine's attention block (QKV projection, RoPE, KV cache,
`DotProductAttention`, output projection) with TE's arguments, module names and weight layouts.

Shapes per `qkv_format` (`h` heads, `g = num_gqa_groups`, `d = kv_channels`):

    sbhd  hidden_states [s, b, hidden] -> q [s, b, h, d], k/v [s, b, g, d] -> out [s, b, hidden]
    bshd  hidden_states [b, s, hidden] -> q [b, s, h, d], k/v [b, s, g, d] -> out [b, s, hidden]
    thd   hidden_states [t, hidden]    -> q [t, h, d],    k/v [t, g, d]    -> out [t, hidden]
          (with cu_seqlens_q / cu_seqlens_kv int32 [b+1] and max_seqlen_q / max_seqlen_kv)

Cross-attention takes keys and values from `encoder_output` (same format, its own length).

Submodules (TE names, so TE state dicts load): self-attention `layernorm_qkv` (LayerNormLinear,
with `input_layernorm`) or `qkv` (Linear); cross-attention `layernorm_query` or `query_layer`, and
`key_value`; then `core_attention` (DotProductAttention) and `proj` (Linear). The QKV rows are
stored in one of three forms (see `qkv_storage`); any form loads into any other.

The projection output reaches `core_attention` as views: k and v are strided slices of it in every
form (the TE issue-1195 layout when GQA meets interleaved weights). q is a view too except for
interleaved weights with `1 < g < h`, where its heads are not equally spaced in memory and one
copy gathers them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..attention.dot_product_attention import DotProductAttention
from ..attention.packing import split_packed
from ..attention.validation import is_whole
from ..errors import ArgumentError, ArgumentTypeError
from ..fp8.extra_state import decode_extra_state
from ..reference_switch import ReferenceSwitch
from .cached_attention import self_attention_with_cache
from .inference import InferenceParams
from .linear import LayerNormLinear, Linear
from .qkv_storage import QKVSpec, install_qkv_storage_hooks, storage_form
from .rope import apply_rotary_pos_emb, rotate_qk

FORMATS = ("sbhd", "bshd", "thd")
_LAYOUTS = {"sbhd": "[s, b, hidden_size]", "bshd": "[b, s, hidden_size]", "thd": "[t, hidden_size]"}


def check_hidden_states(
    x, name: str, hidden_size: int, fmt: str, fmt_arg: str = "qkv_format"
) -> None:
    """A block's input against the layout it was built for: rank 3 (`sbhd`, `bshd`) or 2
    (`thd`), last dim `hidden_size`, floating point. Host-side shape reads only, so it costs no
    device sync and may sit in a captured step. `fmt_arg` names the format in the caller's
    words (`attn_input_format` for `TransformerLayer`)."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    takes = f"{fmt_arg}={fmt!r} takes {_LAYOUTS[fmt]}"
    if x.dim() != (2 if fmt == "thd" else 3):
        hint = ""
        if fmt != "thd" and x.dim() == 2:
            hint = f"; a [t, hidden_size] token batch needs {fmt_arg}='thd' and cu_seqlens_q"
        elif fmt == "thd" and x.dim() == 3:
            hint = f"; a [b, s, hidden_size] batch needs {fmt_arg}='bshd'"
        raise ArgumentError(
            f"{name} has shape {tuple(x.shape)}, but {takes} with hidden_size ({hidden_size})"
            + hint
        )
    if x.shape[-1] != hidden_size:
        raise ArgumentError(
            f"{name} has shape {tuple(x.shape)}: its last dimension must be hidden_size "
            f"({hidden_size}), the width this module was built for ({takes})"
        )
    if not x.is_floating_point():
        raise ArgumentTypeError(
            f"{name} has dtype {x.dtype}: hidden states must be floating point ({takes})"
        )


def split_qkv(
    mixed: torch.Tensor,
    heads: int,
    groups: int,
    head_dim: int,
    interleaved: bool,
    views_reach_attention: bool = True,
):
    """Projection output `[..., (h + 2g) * d]` -> q `[..., h, d]`, k, v `[..., g, d]` (views;
    q is copied only for interleaved rows with `1 < g < h`).

    The split is `split_packed`'s: when q, k and v reach the attention kernels as views, their
    gradients come back as one buffer and `mixed` gets it without a cat. When they do not
    (`views_reach_attention=False`: RoPE makes new q and k tensors, so their gradients are new
    buffers too), torch's own split serves: its backward is the same cat, without a Python
    autograd node (host time per layer).
    """
    lead = mixed.shape[:-1]
    per_group = heads // groups
    split = split_packed if views_reach_attention else _split
    if interleaved:  # rows [g, h/g + 2, d]
        rows = mixed.view(*lead, groups, per_group + 2, head_dim)
        q, k, v = split(rows, -2, [per_group, 1, 1])
    else:  # rows [h/g + 2, g, d] == [all q | all k | all v]
        rows = mixed.view(*lead, per_group + 2, groups, head_dim)
        q, k, v = split(rows, -3, [per_group, 1, 1])
    return (
        q.reshape(*lead, heads, head_dim),
        k.reshape(*lead, groups, head_dim),
        v.reshape(*lead, groups, head_dim),
    )


def _split(rows: torch.Tensor, dim: int, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    return rows.split(sizes, dim)


def split_kv(mixed: torch.Tensor, groups: int, head_dim: int, interleaved: bool):
    """Cross-attention `key_value` output `[..., 2 * g * d]` -> k, v `[..., g, d]` (views,
    through `split_packed`: their gradients come back to `mixed` as one buffer)."""
    lead = mixed.shape[:-1]
    if interleaved:  # rows [g, 2, d]
        k, v = split_packed(mixed.view(*lead, groups, 2, head_dim), -2)
    else:  # rows [2, g, d]
        k, v = split_packed(mixed.view(*lead, 2, groups, head_dim), -3)
    return k, v


class MultiheadAttention(ReferenceSwitch):
    """TE's `MultiheadAttention`; see the module docstring for shapes and layouts.

    Args (TE's names and defaults, except `device=None`: torch's default device, not `"cuda"`):
        hidden_size, num_attention_heads: model width and query heads `h`.
        kv_channels: head size `d` (default `hidden_size // h`).
        num_gqa_groups: KV heads `g` (default `h`; 1 = MQA); `h % g == 0`.
        attention_dropout: dropout on attention probabilities (training mode), default 0.1.
        attn_mask_type, window_size: default mask (TE's names) and sliding window.
        layer_number: key of this layer's KV cache in `InferenceParams` (default 1).
        input_layernorm: normalize the input inside the QKV projection (`layernorm_qkv`).
        attention_type: `self`, or `cross` (keys/values from `encoder_output`).
        fuse_qkv_params, qkv_weight_interleaved: QKV storage form (see `qkv_storage`).
        rotary_pos_interleaved: RoPE channel pairing (adjacent pairs instead of halves).
        return_bias: return the output projection's bias instead of adding it.
        return_layernorm_output: also return the normalized input (with `input_layernorm`).
        normalization, zero_centered_gamma, layernorm_epsilon: the input norm.
        qkv_format: `sbhd`, `bshd` or `thd`.
        params_dtype, device: where and in which dtype parameters are created.
        use_reference: run attention on the pure-PyTorch reference (settable attribute).
        cp_group, cp_global_ranks, cp_stream, cp_comm_type: context parallelism (see
            `set_context_parallel_group`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: int | None = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        layer_number: int | None = None,
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        num_gqa_groups: int | None = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        qkv_format: str = "sbhd",
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        use_reference: bool = False,
        cp_group=None,
        cp_global_ranks: list[int] | None = None,
        cp_stream: torch.cuda.Stream | None = None,
        cp_comm_type: str = "p2p",
    ) -> None:
        super().__init__(use_reference)
        heads = num_attention_heads
        groups = heads if num_gqa_groups is None else num_gqa_groups
        _check_arguments(
            hidden_size, heads, groups, kv_channels, attention_type, qkv_format, layer_number
        )
        head_dim = kv_channels or hidden_size // heads
        self.hidden_size = hidden_size
        self.num_attention_heads = heads
        self.num_gqa_groups = groups
        self.hidden_size_per_attention_head = head_dim
        self.layer_number = 1 if layer_number is None else layer_number
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.attention_type = attention_type
        self.input_layernorm = input_layernorm
        self.return_bias = return_bias
        self.return_layernorm_output = return_layernorm_output
        self.qkv_format = qkv_format
        self.rotary_pos_interleaved = rotary_pos_interleaved
        # TE: separate parameters are always [q | k | v], whatever the interleave flag says.
        self.qkv_weight_interleaved = fuse_qkv_params and qkv_weight_interleaved
        self.qkv_storage = storage_form(fuse_qkv_params, qkv_weight_interleaved)
        common = dict(bias=bias, init_method=init_method, params_dtype=params_dtype, device=device)
        norm = dict(
            eps=layernorm_epsilon,
            normalization=normalization,
            return_layernorm_output=return_layernorm_output,
            zero_centered_gamma=zero_centered_gamma,
        )
        self._build_projections(heads, groups, head_dim, fuse_qkv_params, common, norm)
        self.core_attention = DotProductAttention(
            heads,
            head_dim,
            num_gqa_groups=groups,
            attention_dropout=attention_dropout,
            qkv_format=qkv_format,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
            layer_number=self.layer_number,
            attention_type=attention_type,
        )
        self.proj = Linear(
            heads * head_dim,
            hidden_size,
            bias=bias,
            init_method=output_layer_init_method,
            return_bias=return_bias,
            params_dtype=params_dtype,
            device=device,
        )
        self.register_load_state_dict_pre_hook(_check_core_attention_extra_state)
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.use_reference = use_reference  # propagates to every child with the switch

    def set_context_parallel_group(
        self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p"
    ) -> None:
        """Split every sequence over `cp_group` (None: off): the input holds this rank's chunks
        (`DotProductAttention.set_context_parallel_group`), RoPE rotates each token by its
        position in the full sequence, and thd `cu_seqlens_*` describe the full sequences."""
        self.core_attention.set_context_parallel_group(
            cp_group, cp_global_ranks, cp_stream, cp_comm_type
        )
        self.cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)

    def _build_projections(self, heads, groups, head_dim, fused, common, norm) -> None:
        hidden, form = self.hidden_size, self.qkv_storage
        if self.attention_type == "self":
            rows = {"query": heads * head_dim, "key": groups * head_dim, "value": groups * head_dim}
            split = None if fused else rows
            if self.input_layernorm:
                self.layernorm_qkv = LayerNormLinear(
                    hidden, sum(rows.values()), parameters_split=split, **norm, **common
                )
                qkv = self.layernorm_qkv
            else:
                self.qkv = Linear(hidden, sum(rows.values()), parameters_split=split, **common)
                qkv = self.qkv
            spec = QKVSpec(("query", "key", "value"), (heads, groups, groups), groups, head_dim)
            install_qkv_storage_hooks(qkv, spec, form)
            return
        if self.input_layernorm:
            self.layernorm_query = LayerNormLinear(
                hidden,
                heads * head_dim,
                parameters_split=None if fused else ("query",),
                **norm,
                **common,
            )
            query_spec = QKVSpec(("query",), (heads,), 1, head_dim)
            install_qkv_storage_hooks(self.layernorm_query, query_spec, form)
        else:
            self.query_layer = Linear(hidden, heads * head_dim, **common)
        self.key_value = Linear(
            hidden,
            2 * groups * head_dim,
            parameters_split=None if fused else ("key", "value"),
            **common,
        )
        kv_spec = QKVSpec(("key", "value"), (groups, groups), groups, head_dim)
        install_qkv_storage_hooks(self.key_value, kv_spec, form)

    def _project(self, hidden_states, encoder_output, residual, rotated: bool, first=None):
        """-> q, k, v views (see `split_qkv`), the normalized input (or None) and, with a
        `residual`, the sum `residual + hidden_states` the input norm ran on (else None).
        `rotated`: q and k go through RoPE before attention. `first`: is_first_microbatch."""
        heads, groups = self.num_attention_heads, self.num_gqa_groups
        head_dim, interleaved = self.hidden_size_per_attention_head, self.qkv_weight_interleaved
        if self.attention_type == "self":
            if self.input_layernorm:
                mixed, ln_out, total = self._normed(
                    self.layernorm_qkv, hidden_states, residual, first
                )
            else:
                mixed, ln_out, total = self.qkv(hidden_states, first), None, None
            q, k, v = split_qkv(mixed, heads, groups, head_dim, interleaved, not rotated)
            return q, k, v, ln_out, total
        if encoder_output is None:
            raise ValueError("cross-attention needs encoder_output")
        k, v = split_kv(self.key_value(encoder_output, first), groups, head_dim, interleaved)
        if self.input_layernorm:
            query, ln_out, total = self._normed(
                self.layernorm_query, hidden_states, residual, first
            )
        else:
            query, ln_out, total = self.query_layer(hidden_states, first), None, None
        return query.view(*query.shape[:-1], heads, head_dim), k, v, ln_out, total

    def _normed(self, projection: LayerNormLinear, hidden_states, residual, first=None):
        """`projection(hidden_states, residual=residual)` unpacked: (output, normalized input
        or None, the residual sum or None)."""
        outputs = projection(hidden_states, residual=residual, is_first_microbatch=first)
        if not isinstance(outputs, tuple):
            return outputs, None, None
        ln_out = outputs[1] if self.return_layernorm_output else None
        return outputs[0], ln_out, None if residual is None else outputs[-1]

    def _rotate(self, q, k, rotary_pos_emb, inference_params, cu_seqlens_q, cu_seqlens_kv):
        """Apply RoPE to the new q and k; with a KV cache positions start at the cache offset."""
        q_freqs, k_freqs = (
            rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        )
        start = None
        if inference_params is not None:
            batch = q.shape[1] if self.qkv_format == "sbhd" else q.shape[0]
            start = inference_params.batch_seqlens(batch)
        rope = dict(
            tensor_format=self.qkv_format,
            start_positions=start,
            interleaved=self.rotary_pos_interleaved,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            backend="reference" if self.reference_active else "auto",
        )
        if q_freqs is k_freqs and cu_seqlens_q is cu_seqlens_kv:
            # Self-attention: one table, the same positions; one launch and node for both.
            return rotate_qk(q, k, q_freqs, cu_seqlens=cu_seqlens_q, **rope)
        q = apply_rotary_pos_emb(q, q_freqs, cu_seqlens=cu_seqlens_q, **rope)
        k = apply_rotary_pos_emb(k, k_freqs, cu_seqlens=cu_seqlens_kv, **rope)
        return q, k

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        encoder_output: torch.Tensor | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        checkpoint_core_attention: bool = False,
        inference_params: InferenceParams | None = None,
        rotary_pos_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        is_first_microbatch: bool | None = None,
    ):
        """Attention block; shapes per `qkv_format` in the module docstring.

        `attention_mask` (bool, True = masked out): `[b, 1, 1, s_kv]` for padding masks of
        self-attention, a `([b, 1, 1, s_q], [b, 1, 1, s_kv])` pair for cross-attention, or
        broadcastable to `[b, h, s_q, s_kv]` for `"arbitrary"`. `rotary_pos_emb`: one angle table
        `[s_max, 1, 1, d_rot]` for q and k, or a `(q_table, k_table)` pair. `inference_params`:
        KV cache (self-attention, sbhd/bshd). `checkpoint_core_attention`: recompute attention in
        the backward instead of keeping its activations.

        `residual` (fusedlayers' own, not TE's; hidden_states' shape, dtype and device; needs
        `input_layernorm`): the block runs on `residual + hidden_states`, the add fused into the
        input norm on the kernel path (`apply_add_normalization`), and that sum is returned
        last, for the next residual add of a pre-LN block.

        `is_first_microbatch` (TE's): inside `fp8_autocast`, the projections' FP8 weights are
        cast and kept (True), reused (False) or cast at every call (None). The attention itself
        runs in the activation dtype.

        Returns `out`, then the projection bias if `return_bias`, then the normalized input if
        `input_layernorm and return_layernorm_output`, then the residual sum if `residual` is
        given (a tuple when anything is added).
        """
        check_hidden_states(hidden_states, "hidden_states", self.hidden_size, self.qkv_format)
        if encoder_output is not None:
            check_hidden_states(encoder_output, "encoder_output", self.hidden_size, self.qkv_format)
        if residual is not None and not self.input_layernorm:
            raise ValueError(
                f"residual ({tuple(residual.shape)}, {residual.dtype}, {residual.device}) is "
                "added inside the input norm, and this MultiheadAttention has none "
                "(input_layernorm=False): add it to hidden_states before the call"
            )
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        window_size = self.window_size if window_size is None else window_size
        if self.qkv_format == "thd" and self.attention_type == "self" and cu_seqlens_kv is None:
            cu_seqlens_kv, max_seqlen_kv = cu_seqlens_q, max_seqlen_q
            cu_seqlens_kv_padded = cu_seqlens_q_padded
        rotated = rotary_pos_emb is not None
        q, k, v, ln_out, total = self._project(
            hidden_states, encoder_output, residual, rotated, is_first_microbatch
        )
        if inference_params is not None and self.attention_type == "self":
            if self.core_attention.cp_group is not None:
                raise ValueError("inference_params (KV cache) is not supported with cp_group")
            # Rotation, cache write and attention over the cache, lengths on the device.
            context = self_attention_with_cache(
                self, q, k, v, inference_params,
                attn_mask_type=attn_mask_type, window_size=window_size,
                attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
                checkpoint_core_attention=checkpoint_core_attention,
            )  # fmt: skip
            return self._finish(context, ln_out, total, is_first_microbatch)
        if rotary_pos_emb is not None:
            # Positions count from each sequence's first row in memory (padded offsets if any).
            cu_q = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
            cu_kv = cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
            q, k = self._rotate(q, k, rotary_pos_emb, inference_params, cu_q, cu_kv)
        options = dict(
            attention_mask=attention_mask,
            qkv_format=self.qkv_format,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
        )

        context = self.core_attention(
            q, k, v, checkpoint_core_attention=checkpoint_core_attention, **options
        )
        return self._finish(context, ln_out, total, is_first_microbatch)

    def _finish(self, context, ln_out, total, first=None):
        """Output projection, plus its bias, the normalized input and the residual sum when
        asked for. `first`: is_first_microbatch."""
        projected = self.proj(context, first)
        outputs = projected if self.return_bias else (projected,)
        if self.input_layernorm and self.return_layernorm_output:
            outputs += (ln_out,)
        if total is not None:
            outputs += (total,)
        return outputs if len(outputs) > 1 else outputs[0]


def _check_arguments(
    hidden_size, heads, groups, kv_channels, attention_type, qkv_format, layer_number
) -> None:
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_attention_heads", heads),
        ("num_gqa_groups", groups),
    ):
        if not is_whole(value, 1):
            raise ValueError(f"{name} ({value!r}) must be a positive integer")
    if kv_channels is not None and not is_whole(kv_channels, 1):
        raise ValueError(f"kv_channels ({kv_channels!r}) must be a positive integer or None")
    if kv_channels is None and hidden_size % heads:
        # TE would silently use hidden_size // heads and an attention width != hidden_size.
        raise ValueError(
            f"hidden_size ({hidden_size}) is not divisible by num_attention_heads ({heads}); "
            "pass kv_channels to choose the head size"
        )
    if heads % groups:
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by num_gqa_groups ({groups})"
        )
    if attention_type not in ("self", "cross"):
        raise ValueError(f"attention_type ({attention_type!r}) must be 'self' or 'cross'")
    if qkv_format not in FORMATS:
        raise ValueError(f"qkv_format ({qkv_format!r}) must be one of {FORMATS}")
    if layer_number is not None and layer_number < 1:
        raise ValueError(f"layer_number ({layer_number}) must be a positive integer")


def _check_core_attention_extra_state(module, state_dict, prefix, *_args) -> None:
    # TE 2.x checkpoints carry `core_attention._extra_state` (FP8 attention metadata, present in
    # FP8 runs even with fp8_dpa off), TE 1.x ones do not. The attention here keeps no FP8
    # state: an entry that reads as FP8 metadata (or none) is dropped, since torch would call it
    # unexpected under strict loading; anything else raises.
    key = f"{prefix}core_attention._extra_state"
    if key not in state_dict:
        return
    decode_extra_state(state_dict[key], key)
    if type(module.core_attention).set_extra_state is torch.nn.Module.set_extra_state:
        del state_dict[key]


__all__ = ["MultiheadAttention", "split_qkv", "split_kv"]
