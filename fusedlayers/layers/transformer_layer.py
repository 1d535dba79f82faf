"""`TransformerLayer`: TransformerEngine's encoder/decoder block with TE's arguments and names.

Shapes per `attn_input_format`: `sbhd` `[s, b, hidden]`, `bshd` `[b, s, hidden]`, `thd`
`[t, hidden]` (with `cu_seqlens_q`/`cu_seqlens_kv` int32 `[b+1]`); the output has the input's shape.

Data flow (pre-LN by default; `x` the input, `drop` the hidden dropout):

    a = x + drop(self_attention(x))              # self_attention normalizes its input
    a = a + drop(inter_attention(a, encoder))    # decoder only, cross-attention
    y = a + drop(layernorm_mlp(a))               # layernorm_mlp normalizes its input
    y = layernorm(y)                             # output_layernorm only

Without dropout on the hidden states (`hidden_dropout=0` or eval), the add before the
cross-attention and the one before the MLP run inside that block's input norm
(`layernorm_mlp(out, residual=a)`; one kernel pass on the kernel path).

The residual stream (fusedlayers' extension; pre-LN layers without `output_layernorm` or
`apply_residual_connection_post_layernorm`) moves the two adds at the layer's edges into norms
too: `residual=r` makes the input `x = h + r`, added inside self_attention's norm, and
`return_residual=True` returns the last add's operands instead of their sum, for the next layer
or a final norm to add inside its kernel:

    h, r = layer_1(x, return_residual=True)               # h = drop(layernorm_mlp(a)), r = a
    h, r = layer_2(h, residual=r, return_residual=True)   # layer_2's input is h + r
    y, _ = final_norm(h, residual=r)                      # = final_norm(layer_2(layer_1(x)))

With `apply_residual_connection_post_layernorm` the residuals are the normalized inputs of each
block instead. With `output_layernorm` the self-attention has no input norm (`self_attention.qkv`)
and a final `layernorm` follows, as in TE.

Submodules: `self_attention` (MultiheadAttention), `inter_attention` (decoder), `layernorm_mlp`
(LayerNormMLP), `layernorm` (`output_layernorm`): a TE `TransformerLayer` state dict loads
unchanged, with its `_extra_state` entries when they carry no FP8 state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..reference_switch import ReferenceSwitch
from .inference import InferenceParams
from .mlp import LayerNormMLP
from .multihead_attention import MultiheadAttention, check_hidden_states
from .normalization import fusible_add, make_norm, residual_for_fusion


class TransformerLayer(ReferenceSwitch):
    """TE's `TransformerLayer`; see the module docstring.

    Args (TE's names and defaults, except `device=None`: torch's default device, not `"cuda"`):
        hidden_size, ffn_hidden_size, num_attention_heads, num_gqa_groups, kv_channels: sizes
            (`num_gqa_groups` default: MHA; 1 = MQA).
        hidden_dropout, attention_dropout: dropout after each block / on attention
            probabilities, both 0.1 by default (training mode only).
        self_attn_mask_type, window_size: self-attention mask (default `causal`) and window.
        apply_residual_connection_post_layernorm: residuals from the normalized inputs.
        output_layernorm: post-LN layer (no input norm on self-attention, final `layernorm`).
        layer_type: `encoder`, or `decoder` (adds cross-attention `inter_attention`).
        fuse_qkv_params, qkv_weight_interleaved: QKV storage form (see `qkv_storage`).
        activation: `gelu` (tanh approximation), `relu`, `qgelu`, `srelu`, `silu`, `geglu`,
            `reglu`, `qgeglu`, `sreglu`, `swiglu`.
        normalization, zero_centered_gamma, layernorm_epsilon, bias: as in TE.
        attn_input_format: `sbhd`, `bshd` or `thd`.
        rotary_pos_interleaved: RoPE channel pairing for `rotary_pos_emb`.
        layer_number: KV-cache key (give every layer its own); init_method,
            output_layer_init_method: weight initializers (default normal(0, 0.023)).
        params_dtype, device, use_reference: as in `MultiheadAttention`.
        cp_group, cp_global_ranks, cp_stream, cp_comm_type: context parallelism for the
            self-attention (see `set_context_parallel_group`).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Callable | None = None,
        output_layer_init_method: Callable | None = None,
        layer_number: int | None = None,
        kv_channels: int | None = None,
        self_attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        layer_type: str = "encoder",
        fuse_qkv_params: bool = False,
        qkv_weight_interleaved: bool = True,
        zero_centered_gamma: bool = False,
        bias: bool = True,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        attn_input_format: str = "sbhd",
        rotary_pos_interleaved: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        use_reference: bool = False,
        cp_group=None,
        cp_global_ranks: list[int] | None = None,
        cp_stream: torch.cuda.Stream | None = None,
        cp_comm_type: str = "p2p",
    ) -> None:
        super().__init__(use_reference)
        if layer_type not in ("encoder", "decoder"):
            raise ValueError(f"layer_type ({layer_type!r}) must be 'encoder' or 'decoder'")
        self.layer_type = layer_type
        self.layer_number = layer_number
        self.hidden_dropout = hidden_dropout
        self.self_attn_mask_type = self_attn_mask_type
        self.window_size = window_size
        self.output_layernorm = output_layernorm
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.attn_input_format = attn_input_format
        attention = dict(
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            kv_channels=kv_channels,
            attention_dropout=attention_dropout,
            layernorm_epsilon=layernorm_epsilon,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            layer_number=layer_number,
            num_gqa_groups=num_gqa_groups,
            return_layernorm_output=apply_residual_connection_post_layernorm,
            fuse_qkv_params=fuse_qkv_params,
            qkv_weight_interleaved=qkv_weight_interleaved,
            zero_centered_gamma=zero_centered_gamma,
            bias=bias,
            normalization=normalization,
            qkv_format=attn_input_format,
            rotary_pos_interleaved=rotary_pos_interleaved,
            params_dtype=params_dtype,
            device=device,
        )
        self.self_attention = MultiheadAttention(
            **attention,
            attn_mask_type=self_attn_mask_type,
            window_size=window_size,
            input_layernorm=not output_layernorm,
            attention_type="self",
        )
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                **attention,
                attn_mask_type="padding",
                input_layernorm=True,
                attention_type="cross",
            )
        self._build_mlp(ffn_hidden_size, activation, attention)
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.use_reference = use_reference  # propagates to every child with the switch

    def set_context_parallel_group(
        self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p"
    ) -> None:
        """Split every sequence over `cp_group` (None: off); the input then holds this rank's
        chunks (`MultiheadAttention.set_context_parallel_group`). Only the self-attention is
        split: a decoder's cross-attention reads the whole `encoder_output` on every rank, which
        needs no exchange."""
        self.self_attention.set_context_parallel_group(
            cp_group, cp_global_ranks, cp_stream, cp_comm_type
        )

    def _build_mlp(self, ffn_hidden_size: int, activation: str, shared: dict) -> None:
        """`layernorm_mlp` and, with `output_layernorm`, the final `layernorm`, configured like
        the attention blocks (`shared` holds their keyword arguments)."""
        norm = {key: shared[key] for key in ("zero_centered_gamma", "params_dtype", "device")}
        self.layernorm_mlp = LayerNormMLP(
            shared["hidden_size"],
            ffn_hidden_size,
            eps=shared["layernorm_epsilon"],
            bias=shared["bias"],
            normalization=shared["normalization"],
            activation=activation,
            init_method=shared["init_method"],
            output_layer_init_method=shared["output_layer_init_method"],
            return_layernorm_output=shared["return_layernorm_output"],
            **norm,
        )
        if self.output_layernorm:
            self.layernorm = make_norm(
                shared["normalization"],
                shared["hidden_size"],
                eps=shared["layernorm_epsilon"],
                **norm,
            )

    @property
    def supports_residual_stream(self) -> bool:
        """Whether `forward` takes `residual=` / `return_residual=True`: a pre-LN layer whose
        self-attention has an input norm to add in (no `output_layernorm`) and whose residuals
        are the sums themselves (no `apply_residual_connection_post_layernorm`)."""
        return not (self.output_layernorm or self.apply_residual_connection_post_layernorm)

    def _residual(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + F.dropout(out, p=self.hidden_dropout, training=self.training)

    def _fuse_residual(self, out: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether the residual add before a block (cross-attention, MLP) can move into the
        block's input norm: the residual is the sum itself (not a post-LN output), no dropout
        applies, and both sides share shape, dtype and device (under autocast they may not;
        torch's add then promotes)."""
        return (
            not self.apply_residual_connection_post_layernorm
            and (self.hidden_dropout == 0 or not self.training)
            and fusible_add(out, residual)
        )

    def _add_then(self, block: torch.nn.Module, out, residual, **kwargs):
        """`block` (it normalizes its input) on `residual + drop(out)` -> (its output, the next
        residual: that sum, or with post-LN residuals the block's normalized input). Without
        dropout the add runs inside the block's norm (one kernel pass on the kernel path), and
        the block hands the sum back."""
        if self._fuse_residual(out, residual):
            return block(out, residual=residual, **kwargs)
        hidden = self._residual(out, residual)
        outputs = block(hidden, **kwargs)
        if self.apply_residual_connection_post_layernorm:
            return outputs
        return outputs, hidden

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        self_attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        encoder_output: torch.Tensor | None = None,
        enc_dec_attn_mask: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
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
        residual: torch.Tensor | None = None,
        return_residual: bool = False,
        is_first_microbatch: bool | None = None,
    ):
        """One layer; `hidden_states` and the output are `[s, b, hidden]` / `[b, s, hidden]` /
        `[t, hidden]` per `attn_input_format`.

        `attention_mask` (bool, True = masked out) feeds self-attention for `padding*` /
        `arbitrary` mask types; `enc_dec_attn_mask` feeds cross-attention (a `(q_mask, kv_mask)`
        pair of `[b, 1, 1, s]` padding masks, or None for no mask). For `thd`, `cu_seqlens_q`
        describes this layer's sequences and `cu_seqlens_kv` the encoder's (cross-attention).

        The residual stream (fusedlayers' extension, not TE's; `supports_residual_stream`
        layers only, else a ValueError): `residual` (hidden_states' shape) makes the layer's
        input `hidden_states + residual`, added inside self-attention's input norm.
        `return_residual=True` returns `(mlp_out, residual)`, both hidden_states' shape, instead
        of their sum: the MLP's output after hidden dropout and the residual it joins, for the
        next layer's `residual=` or a final norm's `residual=` to add inside its kernel.

        `is_first_microbatch` (TE's): inside `fp8_autocast`, every projection's FP8 weight is
        cast and kept (True), reused (False) or cast at every call (None).
        """
        fmt, hidden = self.attn_input_format, self.self_attention.hidden_size
        check_hidden_states(hidden_states, "hidden_states", hidden, fmt, "attn_input_format")
        if encoder_output is not None:
            check_hidden_states(encoder_output, "encoder_output", hidden, fmt, "attn_input_format")
        if (residual is not None or return_residual) and not self.supports_residual_stream:
            raise ValueError(
                "residual= and return_residual=True need a pre-LN TransformerLayer (got "
                f"output_layernorm={self.output_layernorm}, apply_residual_connection_post_"
                f"layernorm={self.apply_residual_connection_post_layernorm}; both must be False)"
            )
        mask_type = self.self_attn_mask_type if self_attn_mask_type is None else self_attn_mask_type
        window_size = self.window_size if window_size is None else window_size
        thd = self.attn_input_format == "thd"
        # Passed on only when given, so blocks whose forward predates it keep working.
        microbatch = (
            {} if is_first_microbatch is None else {"is_first_microbatch": is_first_microbatch}
        )
        hidden_states, residual = residual_for_fusion(hidden_states, residual)
        self_outputs = self.self_attention(
            hidden_states,
            attention_mask=attention_mask,
            attn_mask_type=mask_type,
            window_size=window_size,
            checkpoint_core_attention=checkpoint_core_attention,
            inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_q if thd else None,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_q if thd else None,
            residual=residual,
            **microbatch,
        )
        if residual is not None or (
            self.apply_residual_connection_post_layernorm and not self.output_layernorm
        ):
            # (output, the layer's input residual + hidden_states) or (output, normalized input)
            attention_out, residual = self_outputs
        else:
            attention_out, residual = self_outputs, hidden_states
        if self.layer_type == "decoder":
            attention_out, residual = self._add_then(
                self.inter_attention,
                attention_out,
                residual,
                attention_mask=enc_dec_attn_mask,
                encoder_output=encoder_output,
                attn_mask_type="padding" if enc_dec_attn_mask is not None or thd else "no_mask",
                checkpoint_core_attention=checkpoint_core_attention,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_kv,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_kv=max_seqlen_kv,
                **microbatch,
            )
        mlp_out, residual = self._add_then(
            self.layernorm_mlp, attention_out, residual, **microbatch
        )
        if return_residual:
            return F.dropout(mlp_out, p=self.hidden_dropout, training=self.training), residual
        output = self._residual(mlp_out, residual)
        if self.output_layernorm:
            output = self.layernorm(output)
        return output


__all__ = ["TransformerLayer"]
