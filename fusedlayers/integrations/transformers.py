"""Hugging Face transformers on fusedlayers attention: `attn_implementation="fusedlayers"`.

    from fusedlayers.integrations.transformers import register
    register()                                    # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fusedlayers")
    model.set_attn_implementation("fusedlayers")  # or switch a model already loaded

`register(name="fusedlayers", backend="auto")` registers two functions under `name`:
- in `AttentionMaskInterface`, `mask_interface`: the models' mask creators then hand padding,
  cache offsets and packed sequences over as a `MaskLayout` (lengths, where the queries sit, the
  window), not as a dense 4-D mask. Mask patterns it does not recognize (or/and overlays, chunked
  or blockwise attention) come as sdpa's dense boolean mask instead, which is always exact.
- in `AttentionInterface`, `attention_forward`, the call every attention layer makes
  (transformers 5.x, as integrations/sdpa_attention.py and flash_attention.py take it):

    attention_forward(module, query [b, h, s_q, d], key [b, hg, s_k, d], value [b, hg, s_k, d_v],
                      attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, **kwargs)
        -> (attn_output [b, s_q, h, d_v], attn_weights [b, h, s_q, s_k] or None)

How the call is served (q/k/v are read as `[b, s, h, d]` views, K/V never repeated: query head
i reads KV head i // (h / hg)):
- `scaling` -> softmax_scale, `softcap` -> softcap, `dropout` (transformers passes 0 outside
  training) -> dropout_p, `kwargs["deterministic"]` -> deterministic.
- The mask: causality and the window come from the `MaskLayout`, as sdpa and eager follow the
  mask; `is_causal` (else `module.is_causal`) and `sliding_window` are used, in FA2's convention
  (causal window `(w - 1, 0)`), where no mask was made (`attention_mask=None`).
- No padding: one `bshd` call, bottom-right aligned (keys past the last query, as a static
  cache's unused rows, are sliced off as a view).
- Right padding without a cache: the same call with per-sequence lengths, read in place.
- Left padding, gaps, caches: the real tokens are gathered (`thd`, cu_seqlens per sequence),
  attended causally bottom-right, and scattered back; padding queries output 0.
- Decode (kernel path, no gradient, <= DECODE_MAX_QUERIES queries over a cache with no padding
  or left padding): `flash_attn_with_kvcache` (the split-KV decode kernel) on the key/value
  tensors transformers passes, already updated, with `cache_leftpad` and `cache_seqlens`; no
  append, since the transformers cache already holds the new token. With a static cache both
  are device tensors (`MaskLayout.seqlens`, `left_pads`), so generate's compiled step reads no
  host value that changes from step to step and compiles once.
- Packed sequences (position ids that restart, found by transformers' mask creator or, without
  a mask, by FA2's rule; or `cu_seq_lens_q/k` kwargs): one `thd` call over the segments.
- A 4-D mask (a user's own, or a pattern not recognized): bool (True = attend) or additive
  float, as sdpa takes it, applied as a dense mask/bias by the same front end. `position_bias`
  is added as a bias the same way.
- `s_aux` (attention sinks, gpt-oss: one logit per query head, `[h]`, added to every softmax
  row's denominator as `exp(s_aux)`): each route above, and the dense one, runs as without sinks
  and rescales its output by `Z / (Z + exp(s_aux)) = sigmoid(lse - s_aux)`, with lse the row's
  log-sum-exp over the keys. That is exact, and the LSE is differentiable on the kernels as on
  the reference path, so q, k, v and s_aux all get their gradients. Rows with no visible key
  (lse = -inf) output 0, as eager does when only the sink is left.
- `output_attentions=True`: the dense reference path, returning the weights
  `exp(scores - lse)` (pre-dropout; with sinks, the sink's share is left out of the weights, as
  in gpt-oss's eager).
- A tensor keyword this adapter does not know (`sinks`, `indices`, ...) raises
  NotImplementedError naming it: it would otherwise be ignored.

Backend: `backend="auto"` takes the Triton kernels for CUDA tensors and the PyTorch reference
path for CPU tensors, as the modules do; `"kernel"` insists on the kernels (on CPU tensors that
needs `TRITON_INTERPRET=1` exported before Python starts); `"reference"` always takes the
reference path. Register one name per choice, e.g. `register("fusedlayers-ref", backend=
"reference")`. `FUSEDLAYERS_DEBUG=1` logs the route each call site takes; fallbacks away from
the kernels are logged once on the `fusedlayers` logger (a warning where the kernels would
otherwise run).

Tested with transformers 5.4.0, 5.17.0 and 5.24.0 (the CPU suite);
`register()` refuses releases older than `MIN_TRANSFORMERS` (5.4, the first whose mask functions
take `q_length`/`q_offset`). Importing this module does not import
transformers; `register()` does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .._backend import BACKENDS, choose_backend
from .._logging import log_decision
from ..attention.frontend import attention
from ..attention.kvcache import flash_attn_with_kvcache
from ..attention.masks import MaskSpec, flash_attn_spec
from ..attention.reference import attention_reference
from ..attention.validation import FLASH_ATTN_NAMES, KERNEL_DTYPES, MAX_KERNEL_HEAD_DIM
from ..errors import ArgumentError
from ._transformers_masks import (
    MaskLayout,
    Pattern,
    build_layout,
    check_recognition,
    describe,
    flash_window,
)

# 5.4 is the first release whose mask functions take (q_length, q_offset) instead of
# cache_position; the CPU suite passed on 5.4.0, 5.17.0 and 5.24.0.
MIN_TRANSFORMERS = "5.4"
TESTED_TRANSFORMERS = ("5.4.0", "5.17.0", "5.24.0")
# Few queries over a long cache: the split-KV decode kernel's case (one step, or a few
# speculative tokens).
DECODE_MAX_QUERIES = 16
BUILTIN_NAMES = frozenset(
    ("eager", "sdpa", "flex_attention", "paged|eager",
     "flash_attention_2", "flash_attention_3", "flash_attention_4")
)  # fmt: skip
# Keywords transformers passes that do not change the attention (read elsewhere or unused).
_BENIGN = frozenset(
    ("position_ids", "num_items_in_batch", "seq_idx", "cache_position", "use_cache",
     "output_hidden_states", "output_router_logits", "return_dict", "layer_idx", "target_dtype")
)  # fmt: skip
_PACKING = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

logger = logging.getLogger("fusedlayers")
_noted: set[str] = set()
_recognition: dict[str, str] = {}


def _note(key: str, message: str, warn: bool = False) -> None:
    """Log `message` once per process for `key` (a fallback and its reason)."""
    if key in _noted:
        return
    _noted.add(key)
    (logger.warning if warn else logger.info)("transformers attention: %s", message)


@dataclass(slots=True)
class _Call:
    """The options of one attention call, as the front end names them."""

    scale: float | None
    softcap: float
    dropout: float
    deterministic: bool
    backend: str
    sinks: torch.Tensor | None
    tag: str


def _kernel_expected(q: torch.Tensor, call: _Call) -> bool:
    return call.backend == "kernel" or (call.backend == "auto" and q.is_cuda)


def _check_keywords(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name in _BENIGN or name in _PACKING or name in ("output_attentions", "deterministic"):
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(x, torch.Tensor) for x in values):
            raise NotImplementedError(
                f"fusedlayers attention does not serve the keyword {name!r} (a tensor that "
                "changes the attention, which this adapter would otherwise ignore); use "
                "attn_implementation='eager' or 'sdpa' for this model"
            )


def _check_sinks(s_aux, q: torch.Tensor) -> None:
    """s_aux: one floating-point logit per query head, on q's device."""
    h = q.shape[2]
    if not isinstance(s_aux, torch.Tensor):
        raise ArgumentError(f"s_aux must be a tensor of {h} sink logits, got {type(s_aux)}")
    if tuple(s_aux.shape) != (h,) or not s_aux.is_floating_point():
        raise ArgumentError(
            f"s_aux must be a floating-point tensor of shape ({h},), one sink logit per query "
            f"head, got {s_aux.dtype} of shape {tuple(s_aux.shape)}"
        )
    if s_aux.device != q.device:
        raise ArgumentError(f"s_aux is on {s_aux.device}, the query on {q.device}")


# --------------------------------------------------------------------------- the mask side


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """The `AttentionMaskInterface` entry: a `MaskLayout` for the patterns it recognizes, else
    the dense boolean mask `[b, 1, q_length, kv_length]` (True = attend) sdpa would get."""
    if isinstance(attention_mask, MaskLayout):  # generate precomputed it for a static cache
        return attention_mask
    reason = _recognition.get("failed", "")
    pattern = describe(mask_function) if not reason and mask_function is not None else None
    if pattern is not None:
        layout = build_layout(
            pattern, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask
        )
        if isinstance(layout, MaskLayout):
            return layout
        reason = layout
    elif not reason:
        reason = f"mask_function {getattr(mask_function, '__qualname__', mask_function)!r}"
        reason += " is not a plain causal, sliding-window or bidirectional one"
    _note(f"mask:{reason}", f"{reason}: a dense mask serves it")
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
        allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
        use_vmap=kwargs.get("use_vmap", False), device=kwargs.get("device", "cpu"),
    )  # fmt: skip


def _packed_from_kwargs(q, kwargs) -> torch.Tensor | None:
    """cu_seqlens of packed sequences from FA2's keywords (cu_seq_lens_q/k given) or FA2's
    position-ids rule (batch 1, positions that restart); None when neither applies."""
    if all(kwargs.get(n) is not None for n in _PACKING):
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        if cu_q is not cu_k and not torch.equal(cu_q, cu_k):
            raise NotImplementedError(
                "cu_seq_lens_q != cu_seq_lens_k (cross-attention lengths) is not served"
            )
        return cu_q.to(device=q.device, dtype=torch.int32)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or q.shape[0] != 1 or position_ids.shape[-1] <= 1:
        return None
    positions = position_ids.reshape(-1).to(q.device)
    if positions.shape[0] != q.shape[1]:
        return None
    steps = torch.arange(positions.shape[0], device=q.device) + positions.min()
    if not bool((steps != positions).any()):
        return None
    starts = (positions == positions.min()).nonzero().view(-1)
    end = torch.tensor([positions.shape[0]], device=q.device)
    return torch.cat((starts, end)).to(torch.int32)


def _layout_from_keywords(q, k, attention_mask, causal, sliding_window, kwargs) -> MaskLayout:
    """The layout where no mask function spoke: `attention_mask` None or FA2's 2-D padding mask
    (1 = real token; queries are the last s_q of its slots), with FA2's conventions."""
    b, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
    window = flash_window(causal, sliding_window, bidirectional_exact=False)
    if attention_mask is None:
        cu = _packed_from_kwargs(q, kwargs)
        if cu is not None:
            lengths = (cu[1:] - cu[:-1]).tolist()
            if cu[-1].item() != b * s_q:
                raise ArgumentError(f"packed lengths {lengths} do not add up to {b * s_q} tokens")
            return MaskLayout(
                b, s_q, s_k, causal, window, 0, s_q, segments=cu, max_segment=max(lengths),
                segment_ids=torch.repeat_interleave(
                    torch.arange(len(lengths), device=q.device),
                    cu[1:] - cu[:-1],
                ).view(b, s_q),
                form="packed",
            )  # fmt: skip
        return MaskLayout(b, s_q, s_k, causal, window, s_k - s_q, s_k)  # queries at the end
    mask = attention_mask.bool()
    used = min(mask.shape[-1], s_k)  # a static cache's keys run past the mask (FA2 slices them)
    layout = build_layout(
        Pattern(causal, None, None), b, s_q, s_k, used - s_q, 0, mask[:, -used:], window
    )
    if isinstance(layout, str):
        raise ArgumentError(f"attention_mask of shape {tuple(mask.shape)}: {layout}")
    return layout


def _layout_of(attention_mask, q, k, causal, sliding_window, call, kwargs):
    """The call's mask: a MaskLayout, or a 4-D tensor (dense)."""
    if isinstance(attention_mask, MaskLayout):
        layout = attention_mask
        if (layout.batch, layout.q_length, layout.kv_length) != (
            q.shape[0],
            q.shape[1],
            k.shape[1],
        ):
            raise ArgumentError(
                f"the mask was made for batch {layout.batch}, {layout.q_length} queries and "
                f"{layout.kv_length} keys; this layer has q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        expected = flash_window(causal, sliding_window)
        if (layout.causal, layout.window) != (causal, expected):
            _note(
                f"disagree:{call.tag}:{layout.window}:{expected}",
                f"{call.tag}: the mask says {layout.describe()}, the keywords causal={causal}, "
                f"window={expected}; the mask is followed (as sdpa and eager do)",
            )
        cu = (
            _packed_from_kwargs(q, kwargs)
            if all(kwargs.get(n) is not None for n in _PACKING)
            else None
        )
        if cu is not None:
            if layout.form == "packed":
                if not torch.equal(cu, layout.segments):
                    raise ArgumentError(
                        "cu_seq_lens_q/k disagree with the sequences the position ids delimit"
                    )
            elif layout.form == "full":  # FA2's padding-free call: the keywords' sequences
                packed = _layout_from_keywords(q, k, None, layout.causal, None, kwargs)
                packed.window = layout.window
                return packed
            else:
                raise ArgumentError("cu_seq_lens_q/k given together with a padding mask")
        return layout
    if attention_mask is None or attention_mask.dim() == 2:
        return _layout_from_keywords(q, k, attention_mask, causal, sliding_window, kwargs)
    if attention_mask.dim() != 4:
        raise ArgumentError(
            f"attention_mask must be 2-D (padding) or 4-D, got shape {tuple(attention_mask.shape)}"
        )
    return attention_mask


# ---------------------------------------------------------------------- the attention side


def _front(q, k, v, call: _Call, backend: str, **kw):
    """The front end with the call's options; returns (out, lse)."""
    return attention(
        q, k, v, softmax_scale=call.scale, softcap=call.softcap, dropout_p=call.dropout,
        deterministic=call.deterministic, backend=backend, tag=call.tag,
        names=FLASH_ATTN_NAMES, **kw,
    )  # fmt: skip


def _decode_fits(q, k, v, layout: MaskLayout, call: _Call) -> bool:
    """Whether `flash_attn_with_kvcache` serves this call exactly (module docstring)."""
    s_q = q.shape[1]
    if call.dropout > 0 or layout.form not in ("full", "left"):
        return False
    if not layout.causal or s_q > DECODE_MAX_QUERIES or not layout.has_past:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return False
    if q.dtype not in KERNEL_DTYPES or not (k.dtype == v.dtype == q.dtype):
        return False
    if q.shape[-1] > MAX_KERNEL_HEAD_DIM or v.shape[-1] != q.shape[-1]:
        return False
    return choose_backend(call.backend, q, "query")[0]


def _structured(q, k, v, layout: MaskLayout, call: _Call):
    """Attention on a MaskLayout without a dense mask; (out [b, s_q, h, d_v], route)."""
    b, s_q, h = q.shape[:3]
    spec = flash_attn_spec(False, layout.window)  # the window already holds causality
    if _decode_fits(q, k, v, layout, call):
        # A static cache's lengths come as device tensors: its compiled step reads no host int
        # that changes from step to step (the MaskLayout docstring).
        seqlens = layout.kv_used if layout.seqlens is None else layout.seqlens
        pads = layout.left_pads if layout.form == "left" else None
        sinks = call.sinks is not None
        result = flash_attn_with_kvcache(
            q, k, v, cache_seqlens=seqlens, cache_leftpad=pads,
            softmax_scale=call.scale, causal=True, window_size=layout.window,
            softcap=call.softcap, return_softmax_lse=sinks,
        )  # fmt: skip
        route = "decode: flash_attn_with_kvcache"
        if not sinks:
            return result, route
        out, lse = result
        return _with_sinks(out, lse.transpose(1, 2), call), route + " + sinks"
    if layout.form == "packed":
        cu, n = layout.segments, layout.max_segment
        out, lse = _front(
            q.reshape(b * s_q, h, -1), k.reshape(b * s_q, k.shape[2], -1),
            v.reshape(b * s_q, v.shape[2], -1), call, call.backend, qkv_format="thd",
            cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n, mask_spec=spec,
        )  # fmt: skip
        out, lse, route = out.view(b, s_q, h, -1), lse.t().reshape(b, s_q, h), "packed: thd"
    elif layout.kv_valid is None:
        used = layout.kv_used
        out, lse = _front(q, k[:, :used], v[:, :used], call, call.backend, mask_spec=spec)
        lse, route = lse.transpose(1, 2), "no padding: bshd"
    elif layout.form == "right":
        cu, used = layout.right_padded_cu(), layout.kv_used
        padded = MaskSpec(layout.window, bottom_right=True, padding=True, arbitrary=False)
        out, lse = _front(
            q, k[:, :used], v[:, :used], call, call.backend, mask_spec=padded, cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
        )  # fmt: skip
        lse, route = lse.transpose(1, 2), "right padding: bshd with lengths"
    else:
        out, lse = _unpadded(q, k, v, layout, call, call.backend, spec)
        route = f"{layout.form} padding: gathered to thd"
    if call.sinks is not None:
        route += " + sinks"
    return _with_sinks(out, lse, call), route


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, call: _Call) -> torch.Tensor:
    """out [b, s_q, h, d_v] rescaled for the call's sinks, given lse [b, s_q, h] (natural log,
    fp32); `out` itself without sinks.

    A sink adds exp(s_aux) to each row's softmax denominator Z = exp(lse), which scales the row
    by Z / (Z + exp(s_aux)) = sigmoid(lse - s_aux): exact, and differentiable in out, lse and
    s_aux. A row with no visible key has lse = -inf and weight 0, as the sink alone would give.
    """
    if call.sinks is None:
        return out
    h = out.shape[2]
    weight = torch.sigmoid(lse - call.sinks.float().view(1, 1, h))
    return (out.float() * weight.unsqueeze(-1)).to(out.dtype)


def _unpadded(q, k, v, layout: MaskLayout, call: _Call, backend: str, spec):
    """Gather the real tokens, attend them as thd, scatter back (padding queries output 0)."""
    b, s_q, h = q.shape[:3]
    plan = layout.varlen()
    (bq, sq), (bk, sk) = plan["index_q"], plan["index_k"]
    out_t, lse_t = _front(
        q[bq, sq], k[bk, sk], v[bk, sk], call, backend, qkv_format="thd",
        cu_seqlens_q=plan["cu_q"], cu_seqlens_kv=plan["cu_k"],
        max_seqlen_q=plan["max_q"], max_seqlen_kv=plan["max_k"], mask_spec=spec,
    )  # fmt: skip
    out = out_t.new_zeros(b, s_q, h, out_t.shape[-1])
    out[bq, sq] = out_t
    lse = lse_t.new_full((b, s_q, h), float("-inf"))
    lse[bq, sq] = lse_t.t()
    return out, lse


def _dense(q, k, v, mask, position_bias, call: _Call, want_weights: bool):
    """Attention under a 4-D mask (bool True = attend, or additive float) and/or a bias."""
    bias = None
    visible = None
    if mask is not None and mask.dtype == torch.bool:
        visible = mask
    elif mask is not None:
        bias = mask
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    if want_weights:
        return _dense_reference(q, k, v, visible, bias, call)
    kw = {}
    if visible is not None:
        kw.update(attn_mask_type="arbitrary", attention_mask=~visible)
    if bias is not None:
        kw.update(core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    out, lse = _front(q, k, v, call, call.backend, **kw)
    return _with_sinks(out, lse.transpose(1, 2), call), None


def _dense_reference(q, k, v, visible, bias, call: _Call):
    """The reference path under a dense mask, with the weights (`output_attentions`):
    (out, weights [b, h, s_q, s_k]); with sinks, both scaled by sigmoid(lse - s_aux), so the
    weights leave the sink's share out, as gpt-oss's eager does."""
    h, hg = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if call.scale is None else float(call.scale)
    out, lse = attention_reference(
        q, k, v, softmax_scale=scale, attn_mask=None if visible is None else ~visible,
        bias=bias, softcap=call.softcap, dropout_p=call.dropout, return_lse=True,
    )  # fmt: skip
    keys = k.float().repeat_interleave(h // hg, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys) * scale
    if call.softcap > 0:
        scores = call.softcap * torch.tanh(scores / call.softcap)
    if bias is not None:
        scores = scores + bias.float()
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    rows = lse.unsqueeze(-1)
    weights = torch.where(torch.isfinite(rows), torch.exp(scores - rows), 0.0)  # no key: 0
    if call.sinks is not None:
        weights = weights * torch.sigmoid(rows - call.sinks.float().view(1, h, 1, 1))
    return _with_sinks(out, lse.transpose(1, 2), call), weights.to(q.dtype)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention call on fusedlayers (the contract in the module docstring)."""
    position_bias = kwargs.pop("position_bias", None)
    _check_keywords(kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    tag = f"transformers {type(module).__name__}"
    call = _Call(
        scale=scaling, softcap=float(softcap or 0.0), dropout=float(dropout),
        deterministic=bool(kwargs.get("deterministic") or False), backend=backend,
        sinks=s_aux, tag=tag,
    )  # fmt: skip
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, s, h, d] views
    mask = _layout_of(attention_mask, q, k, causal, sliding_window, call, kwargs)
    want_weights = bool(kwargs.get("output_attentions"))
    if s_aux is not None:
        _check_sinks(s_aux, q)
    if isinstance(mask, MaskLayout) and mask.dense_reason and not want_weights:
        _note(f"dense:{mask.dense_reason}", f"{mask.dense_reason}: a dense mask serves it")
    if isinstance(mask, MaskLayout) and (
        mask.dense_reason or want_weights or position_bias is not None
    ):
        mask = mask.dense(device=q.device)
    if isinstance(mask, torch.Tensor) or mask is None:
        if want_weights:
            _note("weights", "output_attentions=True: the dense reference path returns them",
                  warn=_kernel_expected(q, call))  # fmt: skip
        out, weights = _dense(q, k, v, mask, position_bias, call, want_weights)
        sinks = " + sinks" if s_aux is not None else ""
        log_decision(tag + " dense", f"dense mask/bias{sinks}, backend={call.backend}")
        return out, weights
    out, route = _structured(q, k, v, mask, call)
    log_decision(tag + " " + route, f"{route}; {mask.describe()}; backend={call.backend}")
    return out, None


# ------------------------------------------------------------------------------ registration


def _import_transformers():
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "fusedlayers.integrations.transformers needs transformers: "
            "pip install 'fusedlayers[hf]'"
        ) from error
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"transformers {transformers.__version__} is older than {MIN_TRANSFORMERS}, the "
            "oldest release whose mask interface (q_length, q_offset) this adapter follows"
        )
    return transformers


def register(name: str = "fusedlayers", *, backend: str = "auto") -> str:
    """Register fusedlayers attention (and its mask function) with transformers as `name`;
    returns `name`. `backend`: "auto", "kernel" or "reference" (module docstring). Calling it
    again replaces what `name` pointed to."""
    if backend not in BACKENDS:
        raise ArgumentError(f"backend={backend!r} must be one of {BACKENDS}")
    if name in BUILTIN_NAMES:
        raise ArgumentError(f"name={name!r} is one of transformers' own implementations")
    _import_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not _recognition:
        failed = check_recognition()
        _recognition["checked"] = "yes"
        if failed:
            _recognition["failed"] = f"mask recognition disagrees with sdpa_mask ({failed})"
            _note("recognition", _recognition["failed"] + ": every mask is served dense", True)

    def fusedlayers_attention(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend,
                                 **kwargs)  # fmt: skip

    AttentionInterface.register(name, fusedlayers_attention)
    AttentionMaskInterface.register(name, mask_interface)
    return name


__all__ = ["MaskLayout", "attention_forward", "mask_interface", "register"]
