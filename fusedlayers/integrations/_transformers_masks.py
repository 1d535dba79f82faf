"""What a transformers attention mask means, in the terms fusedlayers' attention takes.

transformers' mask creators (`masking_utils.create_causal_mask`,
`create_sliding_window_causal_mask`, `create_bidirectional_mask`, ...) call the function that
`AttentionMaskInterface` holds under the model's `attn_implementation` with `batch_size`,
`q_length`, `kv_length`, `q_offset`, `kv_offset`, `mask_function` and `attention_mask`. Query i
sits at position `q_offset + i`, key slot j (of the key tensor the layer will see) at position
`kv_offset + j`, `attention_mask` is the 2-D padding mask `[b, >= kv_offset + kv_length]`
(True = a real token) indexed by position, and the mask means (what `sdpa_mask` builds densely)

    visible(b, i, j) = mask_function(b, 0, q_offset + i, kv_offset + j)
                       & attention_mask[b, kv_offset + j]

`describe` reads `mask_function` by identity: the plain patterns transformers builds (causal,
sliding-window causal, bidirectional, sliding-window bidirectional, and the packed-sequence forms
of the causal two) are recognized from their code objects and closure values; anything else
(or/and overlays, chunked or blockwise attention) gives None and is served from the dense mask.
`check_recognition` compares what `build_layout` makes of each pattern with `sdpa_mask` on small
cases, once: a transformers release that changed what those functions mean turns recognition
off instead of computing something else.

`MaskLayout` is the structured form the attention function serves without a dense mask: which
key slots hold real tokens, where the queries sit among them, the window in flash-attn's
convention (bottom-right aligned; causal = right side 0) and the packed sequences. Host values
(lengths, offsets) are read once per mask, that is once per forward, not once per layer.

A static cache's decode steps (generate compiles them) see the same shapes every step while
the number of used slots and the queries' slot move on by one. Dynamo specializes the compiled
step on every host int it reads, so what the decode route reads changes from step to step only
on the device: `seqlens` (kv_used, from the cache's `q_offset` tensor) and `left_pads` (from the
2-D mask), next to host values that stay the same (`form`, `has_past`, the window).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass(frozen=True)
class Pattern:
    """A recognized `mask_function`: causal or bidirectional, transformers' `sliding_window`
    (causal: keys with q - w < k <= q; bidirectional: |q - k| <= w) and, for packed sequences,
    the per-token sequence index `[b, s]` (`find_packed_sequence_indices`)."""

    causal: bool
    sliding_window: int | None
    segment_ids: Tensor | None


_CODES: dict[str, object] = {}


def _codes() -> dict[str, object]:
    """The code objects of masking_utils' closures, taken from the installed transformers."""
    if not _CODES:
        from transformers import masking_utils as mu

        dummy = torch.zeros(1, 1, dtype=torch.long)
        factories = dict(
            and_=("and_masks", (mu.causal_mask_function,)),
            sliding=("sliding_window_overlay", (1,)),
            sliding_bidirectional=("sliding_window_bidirectional_overlay", (1,)),
            remap=("remap_positions_for_packed_sequence", (mu.causal_mask_function, dummy)),
            packed=("packed_sequence_mask_function", (dummy,)),
        )
        for key, (name, args) in factories.items():
            # A release without one of them simply has nothing to recognize there.
            factory = getattr(mu, name, None)
            _CODES[key] = None if factory is None else factory(*args).__code__
        _CODES["causal"] = mu.causal_mask_function
        _CODES["bidirectional"] = mu.bidirectional_mask_function
    return _CODES


def _cells(fn) -> dict:
    names = fn.__code__.co_freevars
    return {n: c.cell_contents for n, c in zip(names, fn.__closure__ or ())}


def _terms(fn, out: list) -> bool:
    """Append the (kind, value) terms `fn` is the conjunction of; False for an unknown piece."""
    codes = _codes()
    if fn is codes["causal"] or fn is codes["bidirectional"]:
        out.append(("causal" if fn is codes["causal"] else "bidirectional", None))
        return True
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    cells = _cells(fn)
    if code is codes["and_"] and code is not None and "mask_functions" in cells:
        return all(_terms(f, out) for f in cells["mask_functions"])
    kinds = {
        codes[k]: k for k in ("sliding", "sliding_bidirectional", "remap", "packed") if codes[k]
    }
    needs = dict(
        sliding=("sliding_window",),
        sliding_bidirectional=("sliding_window",),
        remap=("mask_function",),
        packed=("packed_sequence_mask",),
    )
    kind = kinds.get(code)
    if kind is None or not all(n in cells for n in needs[kind]):
        return False
    out.append((kind, cells[needs[kind][0]]))
    return True


def describe(mask_function) -> Pattern | None:
    """The `Pattern` of a transformers `mask_function`, or None where it is not a plain one."""
    terms: list = []
    if not _terms(mask_function, terms):
        return None
    kinds = [k for k, _ in terms]
    if "packed" not in kinds:
        return None if "remap" in kinds else _plain(terms)
    # Packed sequences: the causal pattern within each sequence, on positions remapped to the
    # sequence (newer releases) or on the slots themselves (5.17): within a sequence the
    # positions are consecutive, so both are the slot pattern.
    rest = [(k, v) for k, v in terms if k != "packed"]
    if kinds.count("packed") != 1:
        return None
    if any(k == "remap" for k, _ in rest):
        inner = describe(rest[0][1]) if len(rest) == 1 else None
    else:
        inner = _plain(rest)
    if inner is None or not inner.causal or inner.segment_ids is not None:
        return None
    return Pattern(True, inner.sliding_window, dict(terms)["packed"])


def _plain(terms: list) -> Pattern | None:
    """One causal or bidirectional base, with at most one sliding window of its kind."""
    bases = [k for k, _ in terms if k in ("causal", "bidirectional")]
    windows = [(k, w) for k, w in terms if k.startswith("sliding")]
    if len(bases) != 1 or len(windows) > 1 or len(bases) + len(windows) != len(terms):
        return None
    causal = bases[0] == "causal"
    window = None
    if windows:
        kind, window = windows[0]
        if (kind == "sliding") != causal or not isinstance(window, int) or window < 1:
            return None
    return Pattern(causal, window, None)


def flash_window(causal: bool, sliding_window: int | None, bidirectional_exact: bool = True):
    """flash-attn's `(left, right)` for transformers' `sliding_window`: causal keeps the key of
    the query and the w - 1 before it, `(w - 1, 0)`; the bidirectional overlay keeps
    |q - k| <= w, `(w, w)` (`bidirectional_exact=False`: FA2's `(w - 1, w - 1)`, used where no
    mask says otherwise)."""
    if sliding_window is None:
        return (-1, 0) if causal else (-1, -1)
    w = int(sliding_window)
    if causal:
        return (w - 1, 0)
    return (w, w) if bidirectional_exact else (w - 1, w - 1)


@dataclass(eq=False)
class MaskLayout:
    """A mask as lengths and windows (module docstring). Slots `>= kv_used` are never visible;
    query i sits at key slot `q_start + i`; `kv_valid` (bool `[b, kv_used]`, None = all real)
    says which slots hold real tokens; a query is real when its slot is. `segments`: int32
    cu_seqlens of packed sequences over the `b * q_length` tokens (then q and k are the same
    tokens). `form`: "full" (no padding), "right", "left", "ragged" or "packed".
    `dense_reason`: why the structured paths would not be exact ("" when they are).
    `has_past`: keys precede the queries (`q_start > 0`: the queries follow a cache's tokens).
    On the device, for the decode route (module docstring): `seqlens`, int32 `[b]` kv_used of a
    causal layout whose `q_offset` came as a tensor (a static cache), else None; `left_pads`,
    int32 `[b]` the first real slot of each row (kv_used for a row without one) where padding
    was found, else None."""

    batch: int
    q_length: int
    kv_length: int
    causal: bool
    window: tuple[int, int]
    q_start: int
    kv_used: int
    kv_valid: Tensor | None = None
    segments: Tensor | None = None
    segment_ids: Tensor | None = None
    lengths_k: list[int] = field(default_factory=list)  # real keys per row (host)
    lengths_q: list[int] = field(default_factory=list)  # real queries per row (host)
    seqlens: Tensor | None = None
    left_pads: Tensor | None = None
    max_segment: int = 0
    form: str = "full"
    dense_reason: str = ""
    memo: dict = field(default_factory=dict, repr=False)
    has_past: bool = field(init=False)

    # What generate precomputes for static caches comes back as `attention_mask`; transformers
    # asks `attention_mask.ndim == 2` of it before handing it to the mask function again.
    ndim = 4

    def __post_init__(self) -> None:
        self.has_past = self.q_start > 0

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, 1, self.q_length, self.kv_length)

    def to(self, *args, **kwargs) -> MaskLayout:
        """A copy whose tensors are on another device (what accelerate's hooks call)."""
        moved = {
            name: getattr(self, name).to(*args, **kwargs)
            for name in ("kv_valid", "segments", "segment_ids", "seqlens", "left_pads")
            if getattr(self, name) is not None
        }
        if not moved:
            return self
        return dataclasses.replace(self, **moved, memo={})

    def describe(self) -> str:
        kind = "causal" if self.causal else "bidirectional"
        return f"{kind} window={self.window} padding={self.form}"

    def query_valid(self) -> Tensor | None:
        """bool [b, q_length]: which queries are real tokens (None = all)."""
        if self.kv_valid is None:
            return None
        return self.kv_valid[:, self.q_start : self.q_start + self.q_length]

    def varlen(self) -> dict:
        """Unpadding indices and cu_seqlens of the real tokens (memoized: one set per mask)."""
        if "varlen" not in self.memo:
            valid = self.kv_valid
            device = valid.device
            bk, sk = valid.nonzero(as_tuple=True)
            bq, sq = self.query_valid().nonzero(as_tuple=True)
            self.memo["varlen"] = dict(
                index_q=(bq, sq),
                index_k=(bk, sk),
                cu_q=_cumulative(self.lengths_q, device),
                cu_k=_cumulative(self.lengths_k, device),
                max_q=max(self.lengths_q, default=0),
                max_k=max(self.lengths_k, default=0),
            )
        return self.memo["varlen"]

    def right_padded_cu(self) -> Tensor:
        if "right" not in self.memo:
            self.memo["right"] = _cumulative(self.lengths_k, self.kv_valid.device)
        return self.memo["right"]

    def dense(self, device=None) -> Tensor:
        """bool `[b, 1, q_length, kv_length]`, True = attend: the same mask, materialized. Rows of
        padding queries see nothing (their output is 0, as on the structured paths)."""
        if "dense" in self.memo:
            return self.memo["dense"]
        tensors = [t for t in (self.kv_valid, self.segment_ids) if t is not None]
        device = tensors[0].device if tensors else device
        i = torch.arange(self.q_length, device=device)[:, None]
        j = torch.arange(self.kv_length, device=device)[None, :]
        diagonal = self.q_start + i
        left, right = self.window
        visible = (j < self.kv_used).expand(self.q_length, self.kv_length)
        if left >= 0:
            visible = visible & (j >= diagonal - left)
        if right >= 0:
            visible = visible & (j <= diagonal + right)
        visible = visible.unsqueeze(0).expand(self.batch, -1, -1)
        if self.kv_valid is not None:
            keys = F.pad(self.kv_valid, (0, self.kv_length - self.kv_used))
            visible = visible & keys[:, None, :] & self.query_valid()[:, :, None]
        if self.segment_ids is not None:
            ids = self.segment_ids
            visible = visible & (ids[:, :, None] == ids[:, None, :])
        self.memo["dense"] = visible.unsqueeze(1)
        return self.memo["dense"]


def _cumulative(lengths: list[int], device) -> Tensor:
    """int32 cu_seqlens [n + 1] from host lengths (a host-to-device copy, no sync)."""
    total, values = 0, [0]
    for n in lengths:
        total += n
        values.append(total)
    return torch.tensor(values, dtype=torch.int32, device=device)


def _packed_layout(pattern: Pattern, batch: int, length: int) -> MaskLayout:
    ids = pattern.segment_ids.expand(batch, -1)
    # One id per (row, sequence): rows never share a sequence.
    row = torch.arange(batch, device=ids.device)[:, None] * (length + 1)
    _, counts = torch.unique_consecutive((ids + row).reshape(-1), return_counts=True)
    lengths = counts.tolist()
    window = flash_window(True, pattern.sliding_window)
    return MaskLayout(
        batch, length, length, True, window, 0, length,
        segments=_cumulative(lengths, ids.device), segment_ids=ids.contiguous(),
        max_segment=max(lengths), form="packed",
    )  # fmt: skip


def build_layout(
    pattern: Pattern,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset,
    kv_offset: int,
    attention_mask: Tensor | None,
    window: tuple[int, int] | None = None,
) -> MaskLayout | str:
    """The `MaskLayout` of a recognized pattern, or a reason why the mask must be dense.
    `window` replaces the pattern's (the kwargs' convention, where no mask function spoke)."""
    q_start = int(q_offset) - int(kv_offset)  # q_offset is a tensor for static caches
    if pattern.segment_ids is not None:
        if attention_mask is not None or q_start != 0 or q_length != kv_length:
            return "packed sequences with a padding mask or a cache"
        if tuple(pattern.segment_ids.shape[-1:]) != (q_length,):
            return f"packed sequence ids of shape {tuple(pattern.segment_ids.shape)}"
        return _packed_layout(pattern, batch_size, q_length)
    if q_start < 0 or q_start + q_length > kv_length:
        return f"queries at slots [{q_start}, {q_start + q_length}) outside the {kv_length} keys"
    if window is None:
        window = flash_window(pattern.causal, pattern.sliding_window)
    # Causal: slots after the last query hold future tokens or unused static-cache rows.
    kv_used = q_start + q_length if pattern.causal else kv_length
    if not pattern.causal and pattern.sliding_window is not None and q_start != 0:
        return "a bidirectional sliding window with a cache"
    layout = MaskLayout(batch_size, q_length, kv_length, pattern.causal, window, q_start, kv_used)
    if isinstance(q_offset, Tensor) and pattern.causal:  # kv_used, on the device
        used = q_offset.reshape(1).to(torch.int32) + (q_length - int(kv_offset))
        layout.seqlens = used.expand(batch_size).contiguous()
    if attention_mask is None:
        return layout
    mask = attention_mask.bool()
    end = int(kv_offset) + kv_used
    if mask.shape[-1] < end:  # as sdpa's prepare_padding_mask: missing positions are padding
        mask = F.pad(mask, (0, end - mask.shape[-1]))
    valid = mask[:, int(kv_offset) : end]
    if valid.shape[0] != batch_size:
        valid = valid.expand(batch_size, -1)
    return _with_padding(layout, valid)


def _with_padding(layout: MaskLayout, valid: Tensor) -> MaskLayout:
    """Classify the padding of `valid` (bool [b, kv_used]) with one host read."""
    slots = torch.arange(valid.shape[1], device=valid.device)
    counts = valid.sum(1)
    queries = valid[:, layout.q_start : layout.q_start + layout.q_length].sum(1)
    firsts = torch.where(valid, slots, valid.shape[1]).amin(1)
    lasts = torch.where(valid, slots, -1).amax(1)
    stats = torch.stack((counts, queries, firsts, lasts)).tolist()  # the one host read
    lengths_k, lengths_q, firsts_h, lasts_h = stats
    if all(n == layout.kv_used for n in lengths_k):
        return layout  # no padding after all
    rows = list(zip(lengths_k, firsts_h, lasts_h))
    contiguous = all(n == 0 or last - first + 1 == n for n, first, last in rows)
    if (
        contiguous
        and all(n == 0 or first == 0 for n, first, _ in rows)
        and (layout.q_start == 0 and layout.q_length == layout.kv_used)
    ):
        form = "right"
    elif contiguous and all(n == 0 or last == layout.kv_used - 1 for n, _, last in rows):
        form = "left"
    else:
        form = "ragged"
    reason = ""
    if layout.window != ((-1, 0) if layout.causal else (-1, -1)) and not contiguous:
        reason = "a sliding window over padding with gaps between real tokens"
    layout.kv_valid, layout.form, layout.dense_reason = valid, form, reason
    layout.lengths_k, layout.lengths_q = lengths_k, lengths_q
    layout.left_pads = firsts.to(torch.int32)  # a row without real tokens: kv_used
    return layout


def _recognition_cases():
    """(mask creator name, kwargs) pairs covering every recognized pattern, with padding of
    each form and the cache offsets of dynamic, sliding and static caches."""
    from transformers import masking_utils as mu

    left = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    right = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    gaps = torch.tensor([[1, 0, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 0, 1]])
    packed = mu.find_packed_sequence_indices(positions)
    causal, bidirectional = mu.causal_mask_function, mu.bidirectional_mask_function
    sliding = mu.sliding_window_causal_mask_function(3)
    # Not in every 5.x release: where it is missing there is nothing to recognize.
    sliding_bi = getattr(mu, "sliding_window_bidirectional_mask_function", None)
    cases = []
    for fn in (causal, sliding):
        for mask in (None, left, right, gaps):
            cases.append((fn, 2, 8, 8, 0, 0, mask))  # prefill
            cases.append((fn, 2, 1, 8, 7, 0, mask))  # decode, dynamic cache
            cases.append((fn, 2, 2, 10, 6, 0, mask))  # static cache: unused slots 8, 9
        cases.append((fn, 2, 1, 4, 7, 4, left))  # sliding cache: keys at positions 4..7
        remap = getattr(mu, "remap_positions_for_packed_sequence", None)  # not in 5.17
        inner = fn if remap is None else remap(fn, positions)
        cases.append((mu.and_masks(inner, mu.packed_sequence_mask_function(packed)),
                      2, 8, 8, 0, 0, None))  # fmt: skip
    for fn in (bidirectional, sliding_bi and sliding_bi(2)):
        if fn is None:
            continue
        for mask in (None, left, right, gaps):
            cases.append((fn, 2, 8, 8, 0, 0, mask))
    return cases


def check_recognition() -> str:
    """ "" when every recognized pattern's layout matches `sdpa_mask` on the real queries,
    else a description of the first mismatch."""
    from transformers.masking_utils import sdpa_mask

    for fn, b, q_len, kv_len, q_off, kv_off, mask in _recognition_cases():
        pattern = describe(fn)
        if pattern is None:
            return f"{getattr(fn, '__qualname__', fn)} is not recognized"
        layout = build_layout(pattern, b, q_len, kv_len, q_off, kv_off, mask)
        expected = sdpa_mask(
            batch_size=b, q_length=q_len, kv_length=kv_len, q_offset=q_off, kv_offset=kv_off,
            mask_function=fn, attention_mask=mask, allow_is_causal_skip=False,
        )  # fmt: skip
        if isinstance(layout, str):
            continue  # served from sdpa_mask itself
        got = layout.dense(device="cpu")
        rows = layout.query_valid()
        rows = torch.ones(b, q_len, dtype=torch.bool) if rows is None else rows
        if not torch.equal(got[:, 0][rows], expected.expand(b, 1, q_len, kv_len)[:, 0][rows]):
            return f"{pattern} at q_offset={q_off}, kv_offset={kv_off}, mask={mask}"
    return ""
