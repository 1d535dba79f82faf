"""`InferenceParams`: a per-layer KV cache for generation, in TransformerEngine 1.x's style.

Usage (one prompt, then one token at a time)::

    params = InferenceParams(max_batch_size=b, max_sequence_length=s_max)
    y = model(prompt, inference_params=params)        # s_prompt new tokens
    params.sequence_len_offset += s_prompt
    y = model(next_token, inference_params=params)    # 1 new token over the cached prefix
    params.sequence_len_offset += 1

Each `MultiheadAttention` (self-attention, keyed by `layer_number`) writes its new keys and values
(already rotated by RoPE) at rows `sequence_len_offset ..` of its cache and attends from the new
queries to the whole cached prefix with a bottom-right causal mask, so a decode step costs
`O(s_new * s_cached)`: attention over the prefix is never recomputed.

Cache layout follows the layer's `qkv_format`: `sbhd [s_max, b_max, h_kv, d]`, `bshd [b_max,
s_max, h_kv, d]` (`thd` is not supported for caching). The views handed to attention are strided
slices of it, no copy.
"""

from __future__ import annotations

import torch


class InferenceParams:
    """KV cache state shared by every layer of a model during generation.

    Attributes:
        max_batch_size, max_sequence_length: cache capacity.
        sequence_len_offset: tokens already cached (the caller advances it after each step).
        batch_size_offset: first cache row of the current batch (for micro-batched decoding).
        key_value_memory_dict: `{layer_number: (key_cache, value_cache)}`.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._formats: dict[int, str] = {}

    def allocate_memory(
        self,
        layer_number: int,
        num_gqa_groups: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        qkv_format: str = "sbhd",
        head_dim_v: int | None = None,
    ) -> None:
        """Zero caches for one layer, laid out per `qkv_format` (`sbhd` or `bshd`)."""
        if qkv_format not in ("sbhd", "bshd"):
            raise NotImplementedError(f"KV cache supports sbhd and bshd, not {qkv_format!r}")
        s, b = self.max_sequence_length, self.max_batch_size
        lead = (s, b) if qkv_format == "sbhd" else (b, s)
        key = torch.zeros(*lead, num_gqa_groups, head_dim, dtype=dtype, device=device)
        value = torch.zeros(
            *lead, num_gqa_groups, head_dim_v or head_dim, dtype=dtype, device=device
        )
        self.key_value_memory_dict[layer_number] = (key, value)
        self._formats[layer_number] = qkv_format

    def update(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor, qkv_format: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new `key`/`value` (`sbhd [s_new, b, h_kv, d]` or `bshd [b, s_new, h_kv, d]`)
        at `sequence_len_offset` and return views of the cached prefix including them,
        `[offset + s_new, b, h_kv, d]` / `[b, offset + s_new, h_kv, d]`.

        The cache stores detached values: generation does not backpropagate through it.
        """
        if layer_number not in self.key_value_memory_dict:
            self.allocate_memory(
                layer_number,
                key.shape[-2],
                key.shape[-1],
                key.dtype,
                key.device,
                qkv_format,
                value.shape[-1],
            )
        if self._formats[layer_number] != qkv_format:
            raise ValueError(
                f"layer {layer_number}: cache is {self._formats[layer_number]}, got {qkv_format}"
            )
        key_cache, value_cache = self.key_value_memory_dict[layer_number]
        s_dim, b_dim = (0, 1) if qkv_format == "sbhd" else (1, 0)
        s_new, b = key.shape[s_dim], key.shape[b_dim]
        start, end = self.sequence_len_offset, self.sequence_len_offset + s_new
        b0, b1 = self.batch_size_offset, self.batch_size_offset + b
        if end > self.max_sequence_length or b1 > self.max_batch_size:
            raise ValueError(
                f"KV cache overflow: tokens {start}..{end} of {self.max_sequence_length}, "
                f"batch rows {b0}..{b1} of {self.max_batch_size}"
            )
        new_rows = (slice(start, end), slice(b0, b1))
        prefix = (slice(0, end), slice(b0, b1))
        if qkv_format == "bshd":
            new_rows, prefix = new_rows[::-1], prefix[::-1]
        with torch.no_grad():
            key_cache[new_rows] = key.detach()
            value_cache[new_rows] = value.detach()
        return key_cache[prefix], value_cache[prefix]

    def swap_key_value_dict(self, batch_indices: torch.Tensor | list[int]) -> None:
        """Reorder the batch rows of every cache (beam search): row i <- row batch_indices[i]."""
        for layer_number, (key, value) in self.key_value_memory_dict.items():
            b_dim = 1 if self._formats[layer_number] == "sbhd" else 0
            index = torch.as_tensor(batch_indices, device=key.device, dtype=torch.long)
            self.key_value_memory_dict[layer_number] = (
                key.index_select(b_dim, index),
                value.index_select(b_dim, index),
            )


__all__ = ["InferenceParams"]
