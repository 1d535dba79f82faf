"""An independent, deliberately naive fp64 attention: one query row at a time, plain Python
loops over keys, written from the semantics in docs/internals.md and not from the reference's
code. It is the oracle that checks `fusedlayers.attention.reference.attention_reference` itself."""

from __future__ import annotations

import math

import torch


def naive_row(
    q_row,
    keys,
    values,
    i,
    s_q,
    *,
    scale,
    window,
    bottom_right,
    mask_row,
    bias_row,
    slope,
    softcap,
    keep_row,
    dropout_p,
):
    """Output [d_v] and LSE for query i over keys [s_k, d] / values [s_k, d_v] (float64)."""
    s_k = keys.shape[0]
    diag = i + (s_k - s_q if bottom_right else 0)
    left, right = window
    scores = []
    for j in range(s_k):
        visible = (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
        if mask_row is not None and bool(mask_row[j]):
            visible = False
        if not visible:
            continue
        s = float(q_row @ keys[j]) * scale
        if softcap > 0:
            s = softcap * math.tanh(s / softcap)
        if bias_row is not None:
            s += float(bias_row[j])
        if slope is not None:
            s -= slope * abs(diag - j)
        scores.append((j, s))
    out = torch.zeros(values.shape[1], dtype=torch.float64)
    if not scores:
        return out, float("-inf")
    top = max(s for _, s in scores)
    total = sum(math.exp(s - top) for _, s in scores)
    for j, s in scores:
        p = math.exp(s - top) / total
        if dropout_p > 0:
            p = p * float(keep_row[j]) / (1 - dropout_p)
        out += p * values[j]
    return out, top + math.log(total)


def naive_attention(
    q,
    k,
    v,
    *,
    scale=None,
    window=(-1, -1),
    bottom_right=True,
    mask=None,
    bias=None,
    slopes=None,
    softcap=0.0,
    keep=None,
    dropout_p=0.0,
):
    """Dense q [b, s_q, h, d], k/v [b, s_k, hg, d]; mask/bias/keep as full [b, h, s_q, s_k]
    tensors (or None), slopes [b, h]. Returns out [b, s_q, h, d_v] and lse [b, h, s_q]."""
    b, s_q, h, d = q.shape
    hg = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(b, s_q, h, v.shape[-1], dtype=torch.float64)
    lse = torch.zeros(b, h, s_q, dtype=torch.float64)
    for z in range(b):
        for head in range(h):
            kv_head = head // (h // hg)
            for i in range(s_q):
                row, row_lse = naive_row(
                    q[z, i, head].double(),
                    k[z, :, kv_head].double(),
                    v[z, :, kv_head].double(),
                    i,
                    s_q,
                    scale=scale,
                    window=window,
                    bottom_right=bottom_right,
                    mask_row=None if mask is None else mask[z, head, i],
                    bias_row=None if bias is None else bias[z, head, i].double(),
                    slope=None if slopes is None else float(slopes[z, head]),
                    softcap=softcap,
                    keep_row=None if keep is None else keep[z, head, i],
                    dropout_p=dropout_p,
                )
                out[z, i, head] = row
                lse[z, head, i] = row_lse
    return out, lse
