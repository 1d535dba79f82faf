"""`DotProductAttention`: a drop-in for TransformerEngine's module of the same name.

Shapes per `qkv_format` (h = num_attention_heads, hg = num_gqa_groups, d_qk/d_v = kv_channels):
    sbhd: q [s_q, b, h, d_qk], k [s_kv, b, hg, d_qk], v [s_kv, b, hg, d_v] -> [s_q, b, h * d_v]
    bshd: q [b, s_q, h, d_qk], k [b, s_kv, hg, d_qk], v [b, s_kv, hg, d_v] -> [b, s_q, h * d_v]
    thd:  q [t_q, h, d_qk],    k [t_kv, hg, d_qk],    v [t_kv, hg, d_v]    -> [t_q, h * d_v]
q, k and v may be views into packed buffers (`sb3hd`, `bshd_bs2hd`, heads split from one
projection output, ...): they are read in place through their strides.

Masks (`attn_mask_type`, TE's names): `no_mask`, `causal` (top-left: query i sees keys j <= i),
`causal_bottom_right` (j <= i + s_kv - s_q), `padding`, `padding_causal`,
`padding_causal_bottom_right` (padding from `attention_mask` -- bool `[b, 1, 1, s]`, or a
`(q_mask, kv_mask)` pair for cross attention, True = padded -- or from `cu_seqlens_q/kv`), and
`arbitrary` (bool `attention_mask` broadcastable to `[b, h, s_q, s_kv]`, True = masked out).
`window_size=(left, right)` follows TE's per-mask-type rule (`fusedlayers.attention.masks`).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ArgumentError
from ..reference_switch import ReferenceSwitch
from .context_parallel import check_cp_arguments, context_parallel_attention
from .frontend import attention
from .masks import check_mask_type, normalize_window_size
from .validation import check_dropout, check_head_counts, check_qkv_format, check_softmax_scale


class DotProductAttention(ReferenceSwitch):
    """Scaled dot-product attention with TE's arguments, on the Triton kernels for CUDA tensors.

    Args:
        num_attention_heads: query heads `h`.
        kv_channels: head dim, or `(d_qk, d_v)` when values have another head dim.
        num_gqa_groups: KV heads `hg` (default `h`; 1 = MQA); `h` must be a multiple of it.
        attention_dropout: dropout on the attention probabilities, applied in training mode.
        qkv_format: `sbhd`, `bshd` or `thd` (default for `forward`).
        attn_mask_type: default mask type (TE's names, see the module docstring).
        window_size: default sliding window `(left, right)`, -1 = unbounded.
        softmax_scale: default `1/sqrt(d_qk)`; else a finite number > 0.
        layer_number, attention_type: accepted for TE compatibility (`self` or `cross`).
        sequence_parallel, tp_size, tp_group, get_rng_state_tracker: TE's tensor/sequence
            parallelism arguments; only the single-device defaults are supported.
        cp_group, cp_global_ranks, cp_stream, cp_comm_type: context parallelism, TE's way (see
            `set_context_parallel_group`).
        use_reference: run the pure-PyTorch reference path (also a settable attribute).
        deterministic: bitwise-reproducible gradients (the kernels' backward sums dQ in a second
            pass, without atomics; False allows an atomic-dQ backward where it is enabled,
            see docs/internals.md).
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        tp_group=None,
        layer_number: int | None = None,
        attention_type: str = "self",
        cp_group=None,
        softmax_scale: float | None = None,
        deterministic: bool = False,
        use_reference: bool = False,
        cp_global_ranks: list[int] | None = None,
        cp_stream: torch.cuda.Stream | None = None,
        cp_comm_type: str = "p2p",
    ) -> None:
        super().__init__(use_reference)
        d_qk, d_v = (kv_channels, kv_channels) if isinstance(kv_channels, int) else kv_channels
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        check_head_counts(num_attention_heads, num_gqa_groups, "DotProductAttention: ")
        check_qkv_format(qkv_format)
        check_mask_type(attn_mask_type)
        normalize_window_size(attn_mask_type, window_size)
        check_dropout(attention_dropout)
        if attention_type not in ("self", "cross"):
            raise ArgumentError(f"attention_type={attention_type!r} must be 'self' or 'cross'")
        if sequence_parallel or tp_size != 1 or tp_group is not None:
            raise NotImplementedError(
                "tensor and sequence parallelism are not supported (got "
                f"sequence_parallel={sequence_parallel}, tp_size={tp_size}, tp_group={tp_group})"
            )
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.hidden_size_per_attention_head_k = d_qk
        self.hidden_size_per_attention_head_v = d_v
        self.attention_dropout = float(attention_dropout)
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.layer_number = layer_number
        self.attention_type = attention_type
        check_softmax_scale(softmax_scale)
        self.softmax_scale = d_qk**-0.5 if softmax_scale is None else float(softmax_scale)
        self.deterministic = deterministic
        self.get_rng_state_tracker = get_rng_state_tracker

    def set_context_parallel_group(
        self, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p"
    ) -> None:
        """Split every sequence over the ranks of `cp_group` (None turns it off), TE's way.

        Each rank then passes its slice: for `sbhd`/`bshd` chunks `r` and `2*cp-1-r` of the
        sequence cut into `2*cp` (`context_parallel_indices`), for `thd` those chunks of every
        sequence with `cu_seqlens_*` of the full sequences. K/V travel around the ring
        (`cp_comm_type="p2p"`, the one type supported); `cp_stream`, a second CUDA stream,
        runs the output merges beside the next block's attention. Masks: `no_mask`/`causal`
        (and `padding*` for thd); see `fusedlayers.attention.context_parallel`.
        """
        self.cp_global_ranks = check_cp_arguments(
            cp_group, cp_global_ranks, cp_stream, cp_comm_type
        )
        self.cp_group = cp_group
        self.cp_stream = cp_stream
        self.cp_comm_type = cp_comm_type

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask=None,
        qkv_format: str | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over `query_layer`, `key_layer`, `value_layer` in `qkv_format`.

        Returns `[s_q, b, h*d_v]` (sbhd), `[b, s_q, h*d_v]` (bshd) or `[t_q, h*d_v]` (thd).
        Per-call `qkv_format`, `attn_mask_type` and `window_size` override the constructor's.
        `checkpoint_core_attention=True` recomputes attention in the backward instead of
        keeping its intermediates (same dropout mask: the RNG state is restored).
        """
        qkv_format = self.qkv_format if qkv_format is None else qkv_format
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        window_size = self.window_size if window_size is None else window_size
        kwargs = dict(
            qkv_format=qkv_format,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
            attention_mask=attention_mask,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            softmax_scale=self.softmax_scale,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            dropout_p=self.attention_dropout if self.training else 0.0,
            deterministic=self.deterministic,
            backend="reference" if self.reference_active else "auto",
            tag=f"DotProductAttention(layer_number={self.layer_number})",
            expected_heads=(
                self.num_attention_heads,
                self.num_gqa_groups,
                self.hidden_size_per_attention_head_k,
                self.hidden_size_per_attention_head_v,
            ),
        )

        def run(q, k, v):
            if self.cp_group is not None:
                return self._context_parallel(q, k, v, kwargs)
            return attention(q, k, v, **kwargs)[0]

        if checkpoint_core_attention and torch.is_grad_enabled():
            out = checkpoint(run, query_layer, key_layer, value_layer, use_reentrant=False)
        else:
            out = run(query_layer, key_layer, value_layer)
        return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])

    def _context_parallel(self, q, k, v, kwargs: dict) -> torch.Tensor:
        kwargs = {key: value for key, value in kwargs.items() if key != "tag"}
        return context_parallel_attention(
            q,
            k,
            v,
            cp_group=self.cp_group,
            cp_global_ranks=self.cp_global_ranks,
            cp_stream=self.cp_stream,
            **kwargs,
        )
