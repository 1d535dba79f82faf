"""An independent fp64 oracle for the layers: norms, RoPE, attention blocks and transformer
layers written from TE's definitions with plain loops and einsums, sharing no code with
`fusedlayers` except reading parameters. The other `test_layers_*` files compare against it;
the tests here check the oracle itself against torch's own implementations."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def norm(x, weight, bias, eps, normalization, zero_centered_gamma):
    """Normalize the last dim by the textbook formulas."""
    gamma = weight.double() + (1.0 if zero_centered_gamma else 0.0)
    x = x.double()
    if normalization == "RMSNorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gamma + bias.double()


def activation(x, name):
    """TE's activations from their formulas (gelu: tanh approximation)."""
    gates = {"geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu", "sreglu": "srelu"}
    gates["swiglu"] = "silu"
    if name in gates:
        half = x.shape[-1] // 2
        return activation(x[..., :half], gates[name]) * x[..., half:]
    if name == "gelu":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if name == "qgelu":
        return x / (1 + torch.exp(-1.702 * x))
    if name == "srelu":
        return torch.where(x > 0, x * x, torch.zeros_like(x))
    if name == "silu":
        return x / (1 + torch.exp(-x))
    raise ValueError(name)


def rope(x, positions, d_rot, base=10000.0, interleaved=False):
    """Rotate x [b, s, h, d] at integer positions [b, s] as complex numbers, pair by pair.

    The angles are rounded to fp32 the way TE's (and our) angle table is built, so the oracle
    checks the rotation itself to fp64 precision; the table has its own test.
    """
    out = x.clone()
    n = d_rot // 2
    inv_freq = 1.0 / base ** (torch.arange(0, d_rot, 2, dtype=torch.float32) / d_rot)
    for j in range(n):
        theta = (positions.float() * inv_freq[j]).double()
        rot = torch.polar(torch.ones_like(theta), theta)[:, :, None]
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + n)
        z = torch.complex(x[..., a].double(), x[..., b].double()) * rot
        out[..., a], out[..., b] = z.real.to(x.dtype), z.imag.to(x.dtype)
    return out


def attention(q, k, v, mask_type="no_mask", window=None, bool_mask=None, scale=None):
    """q [b, s_q, h, d], k/v [b, s_k, g, d] -> [b, s_q, h, d]; query head i uses KV head
    i // (h/g); causal top-left unless the mask type says bottom_right."""
    b, s_q, h, d = q.shape
    s_k, g = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    kv_head = torch.tensor([i // (h // g) for i in range(h)])
    k, v = k[:, :, kv_head], v[:, :, kv_head]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    i = torch.arange(s_q)[:, None]
    j = torch.arange(s_k)[None, :]
    diag = i + (s_k - s_q if "bottom_right" in mask_type else 0)
    visible = torch.ones(s_q, s_k, dtype=torch.bool)
    if "causal" in mask_type:
        visible &= j <= diag
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= diag - left
        if right >= 0:
            visible &= j <= diag + right
    visible = visible.expand(b, h, s_q, s_k)
    if bool_mask is not None:
        visible = visible & ~bool_mask
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = weights / weights.sum(-1, keepdim=True)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.double())


def qkv_rows(weight, heads, groups, head_dim, form):
    """Per-head row blocks of a QKV weight/bias in `form`, by explicit index arithmetic:
    returns (q_blocks [h], k_blocks [g], v_blocks [g]), each `[d, ...]`."""
    per = heads // groups
    q, k, v = [None] * heads, [None] * groups, [None] * groups
    for grp in range(groups):
        for j in range(per):
            head = grp * per + j
            if form == "interleaved":
                row = (grp * (per + 2) + j) * head_dim
            else:
                row = head * head_dim
            q[head] = weight[row : row + head_dim]
        if form == "interleaved":
            k_row = (grp * (per + 2) + per) * head_dim
            v_row = k_row + head_dim
        else:
            k_row = (heads + grp) * head_dim
            v_row = (heads + groups + grp) * head_dim
        k[grp] = weight[k_row : k_row + head_dim]
        v[grp] = weight[v_row : v_row + head_dim]
    return q, k, v


def self_attention_weights(mha):
    """(Wq [h*d, hidden], Wk, Wv, bq, bk, bv) of a self-attention MultiheadAttention."""
    lin = mha.layernorm_qkv if mha.input_layernorm else mha.qkv
    h, g, d = mha.num_attention_heads, mha.num_gqa_groups, mha.hidden_size_per_attention_head
    if mha.qkv_storage == "separate":
        ws = (lin.query_weight, lin.key_weight, lin.value_weight)
        bs = (lin.query_bias, lin.key_bias, lin.value_bias) if lin.use_bias else (None,) * 3
        return (*ws, *bs)
    out = [torch.cat(blocks) for blocks in qkv_rows(lin.weight, h, g, d, mha.qkv_storage)]
    if lin.use_bias:
        out += [torch.cat(blocks) for blocks in qkv_rows(lin.bias, h, g, d, mha.qkv_storage)]
    else:
        out += [None] * 3
    return out


def linear(x, weight, bias):
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()


def to_bshd(x, fmt):
    return x.transpose(0, 1) if fmt == "sbhd" else x


def from_bshd(x, fmt):
    return x.transpose(0, 1) if fmt == "sbhd" else x


def mha_self(mha, x_bsh, mask_type="causal", freqs_dim=None, positions=None, interleaved=False):
    """Self-attention block on x [b, s, hidden] (fp64): returns (out, normalized input)."""
    h, g, d = mha.num_attention_heads, mha.num_gqa_groups, mha.hidden_size_per_attention_head
    wq, wk, wv, bq, bk, bv = self_attention_weights(mha)
    ln = x_bsh.double()
    if mha.input_layernorm:
        lin = mha.layernorm_qkv
        ln = norm(
            x_bsh,
            lin.layer_norm_weight,
            lin.layer_norm_bias,
            lin.eps,
            lin.normalization,
            lin.zero_centered_gamma,
        )
    b, s = x_bsh.shape[:2]
    q = linear(ln, wq, bq).view(b, s, h, d)
    k = linear(ln, wk, bk).view(b, s, g, d)
    v = linear(ln, wv, bv).view(b, s, g, d)
    if freqs_dim is not None:
        pos = torch.arange(s).expand(b, s) if positions is None else positions
        q = rope(q, pos, freqs_dim, interleaved=interleaved)
        k = rope(k, pos, freqs_dim, interleaved=interleaved)
    ctx = attention(q, k, v, mask_type).reshape(b, s, h * d)
    return linear(ctx, mha.proj.weight, mha.proj.bias), ln


def mha_cross(mha, x_bsh, enc_bsh):
    """Cross-attention block: queries from x, keys/values from enc (both [b, s, hidden])."""
    h, g, d = mha.num_attention_heads, mha.num_gqa_groups, mha.hidden_size_per_attention_head
    lq = mha.layernorm_query
    ln = norm(
        x_bsh,
        lq.layer_norm_weight,
        lq.layer_norm_bias,
        lq.eps,
        lq.normalization,
        lq.zero_centered_gamma,
    )
    wq = lq.query_weight if mha.qkv_storage == "separate" else lq.weight
    bq = (lq.query_bias if mha.qkv_storage == "separate" else lq.bias) if lq.use_bias else None
    kv = mha.key_value
    if mha.qkv_storage == "separate":
        wk, wv = kv.key_weight, kv.value_weight
        bk, bv = (kv.key_bias, kv.value_bias) if kv.use_bias else (None, None)
    else:
        # interleaved: rows [g, 2, d]; concat: rows [2, g, d]
        shape = (g, 2, d) if mha.qkv_storage == "interleaved" else (2, g, d)
        axis = 1 if mha.qkv_storage == "interleaved" else 0
        wk, wv = (t.reshape(g * d, -1) for t in kv.weight.view(*shape, -1).unbind(axis))
        bk, bv = (None, None)
        if kv.use_bias:
            bk, bv = (t.reshape(g * d) for t in kv.bias.view(*shape).unbind(axis))
    b, s_q = x_bsh.shape[:2]
    s_k = enc_bsh.shape[1]
    q = linear(ln, wq, bq).view(b, s_q, h, d)
    k = linear(enc_bsh, wk, bk).view(b, s_k, g, d)
    v = linear(enc_bsh, wv, bv).view(b, s_k, g, d)
    ctx = attention(q, k, v, "no_mask").reshape(b, s_q, h * d)
    return linear(ctx, mha.proj.weight, mha.proj.bias), ln


def mlp(m, x):
    """LayerNormMLP on x (fp64): returns (out, normalized input)."""
    ln = norm(
        x, m.layer_norm_weight, m.layer_norm_bias, m.eps, m.normalization, m.zero_centered_gamma
    )
    hidden = activation(linear(ln, m.fc1_weight, m.fc1_bias), m.activation)
    return linear(hidden, m.fc2_weight, m.fc2_bias), ln


def transformer_layer(layer, x_bsh, enc_bsh=None, mask_type="causal", freqs_dim=None):
    """TransformerLayer with dropout off, on x [b, s, hidden] (fp64)."""
    post = layer.apply_residual_connection_post_layernorm
    attn, ln = mha_self(layer.self_attention, x_bsh, mask_type, freqs_dim)
    residual = ln if post and not layer.output_layernorm else x_bsh.double()
    hidden = attn + residual
    if layer.layer_type == "decoder":
        attn, ln = mha_cross(layer.inter_attention, hidden, enc_bsh)
        hidden = attn + (ln if post else hidden)
    out, ln = mlp(layer.layernorm_mlp, hidden)
    out = out + (ln if post else hidden)
    if layer.output_layernorm:
        n = layer.layernorm
        out = norm(out, n.weight, n.bias, n.eps, n.normalization, n.zero_centered_gamma)
    return out


# --- the oracle against torch's own implementations -------------------------------------------


def test_oracle_norms_match_torch():
    x = torch.randn(4, 16, dtype=torch.float64)
    w, b = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    ref = F.layer_norm(x, (16,), w, b, 1e-5)
    torch.testing.assert_close(norm(x, w, b, 1e-5, "LayerNorm", False), ref)
    torch.testing.assert_close(norm(x, w - 1, b, 1e-5, "LayerNorm", True), ref)
    rms = F.rms_norm(x, (16,), w, 1e-5)
    torch.testing.assert_close(norm(x, w, None, 1e-5, "RMSNorm", False), rms)


def test_oracle_activations_match_torch():
    x = torch.randn(64, dtype=torch.float64)
    torch.testing.assert_close(activation(x, "gelu"), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(activation(x, "silu"), F.silu(x))
    torch.testing.assert_close(activation(x, "relu"), F.relu(x))


def test_oracle_attention_matches_sdpa():
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64)
    k = torch.randn(2, 7, 2, 8, dtype=torch.float64)
    v = torch.randn(2, 7, 2, 8, dtype=torch.float64)
    kr, vr = (t.repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v))
    for mask_type in ("no_mask", "causal", "causal_bottom_right"):
        i, j = torch.arange(5)[:, None], torch.arange(7)[None]
        allowed = {"no_mask": j >= 0, "causal": j <= i, "causal_bottom_right": j <= i + 2}
        ref = F.scaled_dot_product_attention(
            q.transpose(1, 2), kr, vr, attn_mask=allowed[mask_type]
        ).transpose(1, 2)
        torch.testing.assert_close(attention(q, k, v, mask_type), ref)
