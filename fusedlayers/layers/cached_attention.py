"""Self-attention over an `InferenceParams` KV cache: the decode path of `MultiheadAttention`.

A step of `s_new` new tokens per sequence, with `L[z] = inference_params.pre_step_seqlens[z]`
tokens already cached for sequence z (shapes per `qkv_format`: q `sbhd [s_new, b, h, d]` /
`bshd [b, s_new, h, d]`, k/v the same with `h_kv` heads):
1. RoPE rotates the new q and k at positions `L[z] + i`,
2. k and v are written at cache rows `L[z] + i`,
3. the new queries attend to cache rows `[0, L[z] + s_new)`, bottom-right aligned (query i sits
   at position `L[z] + i`; causal masks see keys up to it, windows count from it).
-> context `sbhd [s_new, b, h * d]` / `bshd [b, s_new, h * d]`.

Two paths:
- kernel: `flash_attn_with_kvcache`'s machinery (`kvcache.cache_attention`: the rope kernel at
  device positions, one indexed write per cache, the split-KV decode kernel reading the lengths
  from the device). Nothing is read back to the host, so a whole decode step can be captured in a
  CUDA graph. Taken for CUDA tensors (and under the interpreter in tests) when the step needs only
  what the decode kernel does: causal or no mask, windows, ALiBi, no dropout, no gradient, equal
  K/V head dims.
- reference: the same steps in PyTorch, then `core_attention` (`DotProductAttention`, on its
  kernels or its reference) over views of the cache. Taken under `use_reference`, on CPU, and for
  everything else (padding and arbitrary masks, biases, gradients). It reads the lengths on the
  host where the mirror does not hold them.
"""

from __future__ import annotations

import torch

from ..attention import frontend, masks
from ..attention.kvcache import cache_attention
from ..attention.validation import KERNEL_DTYPES, MAX_KERNEL_HEAD_DIM
from .inference import InferenceParams
from .rope import apply_rotary_pos_emb, rope_tables

# With a KV cache the new queries are the last rows of the key sequence, so causal masks align
# to the bottom-right corner.
BOTTOM_RIGHT = {"causal": "causal_bottom_right", "padding_causal": "padding_causal_bottom_right"}


def _to_bshd(t: torch.Tensor, qkv_format: str) -> torch.Tensor:
    return t.transpose(0, 1) if qkv_format == "sbhd" else t


def _split_rotary(rotary_pos_emb):
    if rotary_pos_emb is None:
        return None, None
    if isinstance(rotary_pos_emb, tuple):
        return rotary_pos_emb
    return rotary_pos_emb, rotary_pos_emb


def _kernel_blocker(module, q, v, spec, attention_mask, bias_type, alibi_slopes, rotary) -> str:
    """Why this step cannot take the decode kernel ("" when it can)."""
    backend = "reference" if module.reference_active else "auto"
    use_kernel, why = frontend.choose_backend(backend, q, "query_layer")  # tests patch it
    if not use_kernel:
        return why
    if q.dtype not in KERNEL_DTYPES or q.shape[-1] > MAX_KERNEL_HEAD_DIM:
        return f"dtype {q.dtype} / head dim {q.shape[-1]}"
    if v.shape[-1] != q.shape[-1]:
        return f"value head dim {v.shape[-1]} != key head dim {q.shape[-1]}"
    if spec.padding or spec.arbitrary or attention_mask is not None:
        return "padding or arbitrary mask"
    if bias_type not in ("no_bias", "alibi"):
        return f"core_attention_bias_type={bias_type!r}"
    if bias_type == "no_bias" and alibi_slopes is not None:
        return "alibi_slopes with core_attention_bias_type='no_bias' (the front end refuses it)"
    if module.training and module.core_attention.attention_dropout > 0:
        return "attention dropout in training mode"
    if torch.is_grad_enabled() and (q.requires_grad or v.requires_grad):
        return "gradients requested (the decode kernel has no backward)"
    if any(t is not None and (t.dtype == torch.float64 or t.requires_grad) for t in rotary):
        return "an fp64 or trainable RoPE table"
    return ""


def self_attention_with_cache(
    module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: InferenceParams,
    *,
    attn_mask_type: str,
    window_size,
    attention_mask,
    rotary_pos_emb,
    core_attention_bias_type: str,
    core_attention_bias,
    alibi_slopes,
    checkpoint_core_attention: bool,
) -> torch.Tensor:
    """One step of `module` (a self-attention `MultiheadAttention`) over its cache in `params`;
    q, k, v are the projection's unrotated views. See the module docstring."""
    fmt = module.qkv_format
    if fmt == "thd":
        raise NotImplementedError("the KV cache supports qkv_format sbhd and bshd")
    layer = module.layer_number
    mask_type = BOTTOM_RIGHT.get(attn_mask_type, attn_mask_type)
    spec = masks.mask_spec(mask_type, window_size)
    q_bshd, k_bshd, v_bshd = (_to_bshd(t, fmt) for t in (q, k, v))
    b, s_new = q_bshd.shape[:2]
    rotary = _split_rotary(rotary_pos_emb)
    params.cache(layer, k, v, fmt)
    params.check_step(b, s_new, None if rotary[1] is None else rotary[1].shape[0])
    blocker = _kernel_blocker(
        module, q, v, spec, attention_mask, core_attention_bias_type, alibi_slopes, rotary
    )
    if not blocker:
        alibi = core_attention_bias_type == "alibi"
        qkv = (q_bshd, k_bshd, v_bshd)
        out = _kernel_step(module, *qkv, params, spec, rotary, alibi, alibi_slopes)
        out = out.flatten(-2)  # [b, s_new, h * d]
        return out.transpose(0, 1).contiguous() if fmt == "sbhd" else out
    return _reference_step(
        module, q, k, v, params, mask_type, window_size, attention_mask, rotary,
        dict(
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            checkpoint_core_attention=checkpoint_core_attention,
        ),
    )  # fmt: skip


def _kernel_step(module, q, k, v, params, spec, rotary, alibi, alibi_slopes) -> torch.Tensor:
    """Rotate, append and attend through `cache_attention`; q/k/v bshd -> out [b, s, h, d]."""
    b, _, h, _ = q.shape
    key_cache, value_cache, table = params.kernel_view(module.layer_number, b)
    if alibi and alibi_slopes is None:
        alibi_slopes = masks.alibi_slopes_for(h, q.device)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(device=q.device, dtype=torch.float32).reshape(-1, h)
        alibi_slopes = alibi_slopes.expand(b, h)
    q_freqs, k_freqs = rotary
    out, _ = cache_attention(
        q,
        key_cache,
        value_cache,
        params.batch_seqlens(b),
        k=k.detach(),
        v=v.detach(),
        rotary_q=None if q_freqs is None else rope_tables(q_freqs),
        rotary_k=None if k_freqs is None else rope_tables(k_freqs),
        rotary_local=True,  # TE: every token rotates at its own position
        rotary_interleaved=module.rotary_pos_interleaved,
        block_table=table,
        softmax_scale=module.core_attention.softmax_scale,
        window_size=spec.window_size,
        alibi_slopes=alibi_slopes,
        return_lse=False,
    )
    return out


def _reference_step(
    module, q, k, v, params, mask_type, window_size, attention_mask, rotary, options
) -> torch.Tensor:
    """PyTorch rotation and append, then `core_attention` over the cached prefix."""
    fmt, layer = module.qkv_format, module.layer_number
    b = q.shape[1] if fmt == "sbhd" else q.shape[0]
    s_new = q.shape[0] if fmt == "sbhd" else q.shape[1]
    seqlens = params.batch_seqlens(b)
    lens = params.host_lengths(b)
    ragged = lens is None or len(set(lens)) != 1
    plain = mask_type in ("no_mask", "causal_bottom_right")
    if ragged and (attention_mask is not None or not plain):
        raise NotImplementedError(
            f"attn_mask_type={mask_type!r}"
            + (" with an attention_mask" if attention_mask is not None else "")
            + " needs one cache length for the whole batch, known on the host (set "
            "sequence_len_offset), not per-sequence lengths"
        )
    if rotary[0] is not None:
        rope = dict(
            tensor_format=fmt,
            start_positions=seqlens,
            interleaved=module.rotary_pos_interleaved,
            backend="reference" if module.reference_active else "auto",
        )
        q = apply_rotary_pos_emb(q, rotary[0], **rope)
        k = apply_rotary_pos_emb(k, rotary[1], **rope)
    params.append(layer, _to_bshd(k, fmt), _to_bshd(v, fmt))
    if not ragged:
        # One length for the whole batch, known on the host: the prefix is dense.
        key, value = params.prefix(layer, b, lens[0] + s_new)
        extra = dict(attention_mask=attention_mask, attn_mask_type=mask_type)
    else:
        # Per-sequence lengths: right-padded keys described by cu_seqlens (the front end reads
        # them on the host), attended bottom-right per sequence.
        ends = seqlens.long() + s_new
        end = max(lens) + s_new if lens is not None else params.max_sequence_length
        key, value = params.prefix(layer, b, end)
        cu_kv = torch.cat((ends.new_zeros(1), ends.cumsum(0))).to(torch.int32)
        cu_q = torch.arange(0, (b + 1) * s_new, s_new, device=q.device, dtype=torch.int32)
        padded = "padding" if mask_type == "no_mask" else "padding_causal_bottom_right"
        extra = dict(attn_mask_type=padded, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    if fmt == "sbhd":
        key, value = key.transpose(0, 1), value.transpose(0, 1)
    return module.core_attention(q, key, value, window_size=window_size, **extra, **options)


__all__ = ["BOTTOM_RIGHT", "self_attention_with_cache"]
