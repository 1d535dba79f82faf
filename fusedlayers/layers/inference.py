"""`InferenceParams`: the KV cache of a model during generation, under TransformerEngine's names.

Usage (one prompt, then one token at a time)::

    params = InferenceParams(max_batch_size=b, max_sequence_length=s_max)
    y = model(prompt, inference_params=params)        # s_prompt new tokens
    params.sequence_len_offset += s_prompt            # or params.advance(s_prompt)
    y = model(next_token, inference_params=params)    # 1 new token over the cached prefix
    params.sequence_len_offset += 1

State:
- `pre_step_seqlens`: int32 `[max_batch_size]` on the caches' device, the tokens cached per
  sequence before the current step (TE 2.x's name; `get_seqlens_pre_step()` returns it). Every
  layer reads it on the device: RoPE positions, cache-write rows and the attention's key counts
  come from it, so a decode step holds no host sync and can be captured in a CUDA graph.
- A host mirror of those lengths, kept only while the caller sets them from the host
  (`sequence_len_offset = n`, `+= n`, `advance(n)`, `set_sequence_lengths([..])`); the layers use
  it to check capacity and RoPE-table bounds on the host. `advance(tensor)`, `advance` under
  CUDA-graph capture and direct writes to `pre_step_seqlens` leave it unknown: those calls go
  unchecked (validate one step eagerly first), and `sequence_len_offset` then reads the device.

Each `MultiheadAttention` (self-attention, keyed by `layer_number`) writes its new keys and values
(already rotated) at rows `pre_step_seqlens[z] ..` of sequence z's cache and attends from the new
queries to rows `[0, pre_step_seqlens[z] + s_new)` with a bottom-right causal mask: a decode step
costs `O(s_new * s_cached)`. Sequences may have different lengths (ragged batches).

Cache layouts: contiguous caches follow the layer's `qkv_format`, `sbhd [s_max, b_max, h_kv, d]`
or `bshd [b_max, s_max, h_kv, d]` (`thd` is not supported); paged caches (`is_paged=True`) are
`[total_num_pages, page_size, h_kv, d]` with `block_table` int32 `[max_batch_size,
max_sequence_length // page_size]` (logical row j of sequence z is row `j % page_size` of page
`block_table[z, j // page_size]`; by default sequence z owns pages `z * P .. z * P + P - 1`, and
the caller may rewrite rows of it in place).
"""

from __future__ import annotations

import torch

from ..attention.kvcache import append_to_cache

# The decode kernel's page rule (kernels/_flash_decode.py: a key block never spans two pages),
# stated here too so that a paged cache is refused before any kernel is imported or launched.
_PAGE_MULTIPLE = 16


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")
    return value


class InferenceParams:
    """KV cache state shared by every layer of a model during generation.

    Args (TransformerEngine's names):
        max_batch_size, max_sequence_length: cache capacity.
        num_heads_kv, head_dim_k, dtype, head_dim_v: cache geometry, needed only to allocate a
            layer's cache before its first step (`allocate_memory(layer_number)`); otherwise
            taken from the first keys and values a layer writes.
        is_paged, page_size, total_num_pages: a paged cache (page_size a multiple of 16; default
            and minimum total_num_pages = max_batch_size * max_sequence_length / page_size).
        device: where the lengths (and caches allocated ahead) live; default: the device of the
            first cache allocated.

    Attributes:
        sequence_len_offset: tokens cached per sequence (TE 1.x; one value for the whole batch).
        batch_size_offset: first cache row of the current batch (micro-batched decoding).
        pre_step_seqlens: int32 `[max_batch_size]` device lengths (see the module docstring).
        key_value_memory_dict: `{layer_number: (key_cache, value_cache)}`.
        block_table: int32 `[max_batch_size, pages per sequence]` when paged, else None.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_sequence_length: int,
        num_heads_kv: int | None = None,
        head_dim_k: int | None = None,
        dtype: torch.dtype | None = None,
        head_dim_v: int | None = None,
        is_paged: bool = False,
        total_num_pages: int | None = None,
        page_size: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.max_batch_size = _positive_int(max_batch_size, "max_batch_size")
        self.max_sequence_length = _positive_int(max_sequence_length, "max_sequence_length")
        self.num_heads_kv, self.head_dim_k, self.dtype = num_heads_kv, head_dim_k, dtype
        self.head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        self.is_paged = bool(is_paged)
        self.batch_size_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._formats: dict[int, str] = {}
        self._device = None if device is None else torch.device(device)
        self.pre_step_seqlens = torch.zeros(
            max_batch_size, dtype=torch.int32, device=self._device or "cpu"
        )
        self._host_seqlens: list[int] | None = [0] * max_batch_size
        self.page_size = self.total_num_pages = self.block_table = None
        if self.is_paged:
            self._init_pages(page_size, total_num_pages)

    def _init_pages(self, page_size, total_num_pages) -> None:
        page_size = _positive_int(page_size, "page_size")
        if page_size % _PAGE_MULTIPLE:
            raise ValueError(
                f"page_size ({page_size}) must be a multiple of {_PAGE_MULTIPLE}: a key block of "
                "the decode kernel never spans two pages"
            )
        if self.max_sequence_length % page_size:
            raise ValueError(
                f"max_sequence_length ({self.max_sequence_length}) must be a multiple of "
                f"page_size ({page_size})"
            )
        pages = self.max_sequence_length // page_size
        need = self.max_batch_size * pages
        total = need
        if total_num_pages is not None:
            total = _positive_int(total_num_pages, "total_num_pages")
        if total < need:
            raise ValueError(
                f"total_num_pages ({total}) must be at least max_batch_size * "
                f"max_sequence_length / page_size = {need}"
            )
        self.page_size, self.total_num_pages = page_size, total
        table = torch.arange(need, dtype=torch.int32, device=self._device or "cpu")
        self.block_table = table.view(self.max_batch_size, pages)

    # ----------------------------------------------------------------------------------------
    # Lengths
    # ----------------------------------------------------------------------------------------

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """The device lengths, int32 `[max_batch_size]` (TE 2.x's accessor)."""
        return self.pre_step_seqlens

    @property
    def sequence_len_offset(self) -> int:
        """Tokens cached per sequence; the host mirror, or one read of the device lengths when
        the mirror is unknown. Raises when the sequences of the current batch differ."""
        lens = self._host_seqlens
        if lens is None:
            lens = self.pre_step_seqlens.tolist()  # a host read: the mirror is unknown
        rows = set(lens)
        if len(rows) != 1:
            raise ValueError(
                f"sequence_len_offset is undefined: the sequences hold different lengths "
                f"{lens[:16]}; read pre_step_seqlens instead"
            )
        return rows.pop()

    @sequence_len_offset.setter
    def sequence_len_offset(self, value: int) -> None:
        self.set_sequence_lengths([value] * self.max_batch_size)

    def set_sequence_lengths(self, lengths) -> None:
        """Set every sequence's cached length from the host (list of `max_batch_size` ints):
        a ragged batch, or a new prompt (`[0] * max_batch_size`). Updates the device tensor in
        place, so a captured graph sees the new values."""
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.max_batch_size:
            raise ValueError(
                f"lengths has {len(lengths)} entries, max_batch_size is {self.max_batch_size}"
            )
        bad = [n for n in lengths if not 0 <= n <= self.max_sequence_length]
        if bad:
            raise ValueError(
                f"sequence lengths {bad[:8]} are outside [0, max_sequence_length = "
                f"{self.max_sequence_length}]"
            )
        host = torch.tensor(lengths, dtype=torch.int32)
        self.pre_step_seqlens.copy_(host)
        self._host_seqlens = lengths

    def advance(self, n: int | torch.Tensor, batch_size: int | None = None) -> None:
        """Add `n` (an int, or an int tensor `[batch_size]` on the device) to the lengths of the
        current batch's rows, on the device: the step after `n` new tokens were written.
        Capturable in a CUDA graph (the host mirror becomes unknown then)."""
        b0 = self.batch_size_offset
        b1 = self.max_batch_size if batch_size is None else b0 + batch_size
        rows = self.pre_step_seqlens[b0:b1]
        rows += n  # in place: a captured graph keeps pointing at the same tensor
        capturing = rows.is_cuda and torch.cuda.is_current_stream_capturing()
        if isinstance(n, torch.Tensor) or capturing:
            self._host_seqlens = None
        else:
            self.note_advanced(n, batch_size)

    def note_advanced(self, n: int, batch_size: int | None = None) -> None:
        """Record on the host that the device lengths of the current batch's rows grew by `n`
        elsewhere (a replayed graph that captured `advance(n)`), keeping the mirror exact."""
        if self._host_seqlens is not None:
            b0 = self.batch_size_offset
            b1 = self.max_batch_size if batch_size is None else b0 + batch_size
            self._host_seqlens[b0:b1] = [x + int(n) for x in self._host_seqlens[b0:b1]]

    def reset(self) -> None:
        """Forget every sequence (lengths 0); the caches stay allocated."""
        self.sequence_len_offset = 0

    def host_lengths(self, b: int) -> list[int] | None:
        """Host lengths of the current batch's `b` rows, or None when only the device knows."""
        if self._host_seqlens is None:
            return None
        return self._host_seqlens[self.batch_size_offset : self.batch_size_offset + b]

    def batch_seqlens(self, b: int) -> torch.Tensor:
        """Device lengths of the current batch's `b` rows (a view)."""
        return self.pre_step_seqlens[self.batch_size_offset : self.batch_size_offset + b]

    def positions(self, b: int, s: int, device: torch.device | None = None) -> torch.Tensor:
        """Positions `[b, s]` (int64) of `s` new tokens per sequence, on the device.

        `device`: where the model runs. A model asks for positions before its first layer has
        allocated a cache (learned position embeddings), when the lengths may still be on the
        CPU; they move there once, as a layer's first cache would move them.
        """
        if device is not None:
            self._place(device)
        start = self.batch_seqlens(b).long()[:, None]
        return start + torch.arange(s, device=start.device)

    def check_step(self, b: int, s_new: int, rotary_positions: int | None = None) -> None:
        """Host checks of a step of `s_new` tokens for `b` sequences, before any write: batch
        rows and (while the host mirror is known) capacity and the RoPE table's length."""
        b0, b1 = self.batch_size_offset, self.batch_size_offset + b
        if b1 > self.max_batch_size:
            raise ValueError(
                f"KV cache overflow: batch rows {b0}..{b1} of max_batch_size {self.max_batch_size}"
            )
        lens = self.host_lengths(b)
        if not lens:
            return
        end = max(lens) + s_new
        if end > self.max_sequence_length:
            raise ValueError(
                f"KV cache overflow: tokens {max(lens)}..{end} of max_sequence_length "
                f"{self.max_sequence_length}"
            )
        if rotary_positions is not None and end > rotary_positions:
            raise ValueError(
                f"the RoPE table has {rotary_positions} positions, but position {end - 1} is needed"
            )

    # ----------------------------------------------------------------------------------------
    # Caches
    # ----------------------------------------------------------------------------------------

    def allocate_memory(
        self,
        layer_number: int,
        num_gqa_groups: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        qkv_format: str = "bshd",
        head_dim_v: int | None = None,
    ) -> None:
        """Zero caches for one layer; geometry defaults to the constructor's (TE 2.x's
        `allocate_memory(layer_number)`). Contiguous caches are laid out per `qkv_format`
        (`sbhd` or `bshd`); paged ones are `[total_num_pages, page_size, h_kv, d]`."""
        heads = self.num_heads_kv if num_gqa_groups is None else num_gqa_groups
        d_k = self.head_dim_k if head_dim is None else head_dim
        d_v = head_dim_v or (d_k if head_dim is not None else self.head_dim_v)
        dtype = self.dtype if dtype is None else dtype
        device = torch.device(device) if device is not None else self._device
        if None in (heads, d_k, dtype, device):
            raise ValueError(
                "allocate_memory needs num_heads_kv, head_dim_k, dtype and device (from the "
                "constructor or as arguments)"
            )
        if qkv_format not in ("sbhd", "bshd"):
            raise NotImplementedError(f"KV cache supports sbhd and bshd, not {qkv_format!r}")
        self._place(device)
        if self.is_paged:
            lead = (self.total_num_pages, self.page_size)
        else:
            s, b = self.max_sequence_length, self.max_batch_size
            lead = (s, b) if qkv_format == "sbhd" else (b, s)
        key = torch.zeros(*lead, heads, d_k, dtype=dtype, device=device)
        value = torch.zeros(*lead, heads, d_v, dtype=dtype, device=device)
        self.key_value_memory_dict[layer_number] = (key, value)
        self._formats[layer_number] = qkv_format

    def _place(self, device: torch.device) -> None:
        """Lengths and block table live with the caches; every cache on one device."""
        if self._device is not None and self.key_value_memory_dict and device != self._device:
            raise ValueError(
                f"every layer's cache must be on one device: {self._device}, got {device}"
            )
        self._device = device
        if self.pre_step_seqlens.device != device:
            self.pre_step_seqlens = self.pre_step_seqlens.to(device)
        if self.block_table is not None and self.block_table.device != device:
            self.block_table = self.block_table.to(device)

    def cache(self, layer_number: int, key: torch.Tensor, value: torch.Tensor, qkv_format: str):
        """This layer's (key_cache, value_cache), allocated on first use from `key`/`value`
        (`sbhd [s, b, h_kv, d]` or `bshd [b, s, h_kv, d]`)."""
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
        for name, new, cached in (("key", key, key_cache), ("value", value, value_cache)):
            if new.shape[-2:] != cached.shape[-2:] or new.dtype != cached.dtype:
                raise ValueError(
                    f"layer {layer_number}: new {name} heads/dim/dtype {tuple(new.shape[-2:])}, "
                    f"{new.dtype} differ from the cache's {tuple(cached.shape[-2:])}, "
                    f"{cached.dtype}"
                )
        return key_cache, value_cache

    def kernel_view(self, layer_number: int, b: int):
        """(key_cache, value_cache, block_table) as the decode kernel takes them for the current
        batch: contiguous caches as `[b, s_max, h_kv, d]` views (strided for sbhd), paged caches
        whole with the batch's rows of the block table."""
        key_cache, value_cache = self.key_value_memory_dict[layer_number]
        b0, b1 = self.batch_size_offset, self.batch_size_offset + b
        if self.is_paged:
            return key_cache, value_cache, self.block_table[b0:b1]
        if self._formats[layer_number] == "sbhd":
            key_cache, value_cache = key_cache.transpose(0, 1), value_cache.transpose(0, 1)
        return key_cache[b0:b1], value_cache[b0:b1], None

    def append(self, layer_number: int, key_bshd: torch.Tensor, value_bshd: torch.Tensor) -> None:
        """Write new keys/values `[b, s_new, h_kv, d]` at rows `pre_step_seqlens[z] ..` of the
        current batch's sequences, indexing on the device (no host read). Stores detached
        values: generation does not backpropagate through the cache."""
        b = key_bshd.shape[0]
        key_cache, value_cache, table = self.kernel_view(layer_number, b)
        with torch.no_grad():
            append_to_cache(
                key_cache, value_cache, key_bshd.detach(), value_bshd.detach(),
                self.batch_seqlens(b), None, table,
            )  # fmt: skip

    def update(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor, qkv_format: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `key`/`value` (`sbhd [s_new, b, h_kv, d]` or `bshd [b, s_new, h_kv, d]`) and
        return the cached keys/values of the current batch in `qkv_format`, rows `[0, end)`:
        `end` = the longest sequence after the append when the host mirror is known, else the
        whole capacity (rows past a sequence's length are stale; mask them by length)."""
        self.cache(layer_number, key, value, qkv_format)
        b_dim = 1 if qkv_format == "sbhd" else 0
        b, s_new = key.shape[b_dim], key.shape[1 - b_dim]
        self.check_step(b, s_new)
        to_bshd = (lambda t: t.transpose(0, 1)) if qkv_format == "sbhd" else (lambda t: t)
        self.append(layer_number, to_bshd(key), to_bshd(value))
        lens = self.host_lengths(b)
        end = max(lens) + s_new if lens else self.max_sequence_length
        key_bshd, value_bshd = self.prefix(layer_number, b, end)
        if qkv_format == "sbhd":
            return key_bshd.transpose(0, 1), value_bshd.transpose(0, 1)
        return key_bshd, value_bshd

    def prefix(self, layer_number: int, b: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `[0, end)` of the current batch's caches as `[b, end, h_kv, d]`: views of a
        contiguous cache, a gather of the pages of a paged one."""
        key_cache, value_cache, table = self.kernel_view(layer_number, b)
        if table is None:
            return key_cache[:, :end], value_cache[:, :end]
        pages = table.long()  # [b, P]: gather every page of each sequence, then cut at end
        gather = lambda c: c[pages].flatten(1, 2)[:, :end]  # noqa: E731
        return gather(key_cache), gather(value_cache)

    def swap_key_value_dict(self, batch_indices: torch.Tensor | list[int]) -> None:
        """Reorder the batch rows (beam search): row i <- row batch_indices[i], for every cache
        (or the block table when paged) and the lengths, in place."""
        device = self.pre_step_seqlens.device
        index = torch.as_tensor(batch_indices, dtype=torch.long, device=device)
        n = index.numel()

        def reorder(t: torch.Tensor, dim: int) -> None:
            # index_select copies first, so rows read before any is overwritten
            t.narrow(dim, 0, n).copy_(t.index_select(dim, index))

        if self.is_paged:
            reorder(self.block_table, 0)
        else:
            for layer_number, (key, value) in self.key_value_memory_dict.items():
                b_dim = 1 if self._formats[layer_number] == "sbhd" else 0
                reorder(key, b_dim)
                reorder(value, b_dim)
        reorder(self.pre_step_seqlens, 0)
        if self._host_seqlens is not None:
            order = [int(i) for i in batch_indices]
            self._host_seqlens[:n] = [self._host_seqlens[i] for i in order]


__all__ = ["InferenceParams"]
