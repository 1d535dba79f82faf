"""The pieces the layers use, against the oracle in `test_layers_oracle.py` or first principles:
RoPE tables and rotation (rotate-half, interleaved, partial, sbhd/bshd/thd, start offsets),
norm modules, Linear/LayerNormLinear options and LayerNormMLP outputs."""

from __future__ import annotations

import pytest
import test_layers_oracle as oracle
import torch

from fusedlayers.layers.linear import LayerNormLinear, Linear
from fusedlayers.layers.mlp import LayerNormMLP
from fusedlayers.layers.normalization import LayerNorm, RMSNorm
from fusedlayers.layers.rope import RotaryPositionEmbedding, apply_rotary_pos_emb


def test_rope_table_layout():
    table = RotaryPositionEmbedding(8, rotary_base=100.0)(5, offset=2)
    assert table.shape == (5, 1, 1, 8) and table.dtype == torch.float32
    inv = 100.0 ** -(torch.arange(0, 8, 2) / 8)
    angles = torch.outer(torch.arange(2, 7).float(), inv)
    torch.testing.assert_close(table[:, 0, 0], torch.cat([angles, angles], -1))
    inter = RotaryPositionEmbedding(8, rotary_base=100.0, interleaved=True)(5, offset=2)
    torch.testing.assert_close(inter[:, 0, 0], angles.repeat_interleave(2, -1))
    assert RotaryPositionEmbedding(8, rotary_percent=0.5)(3).shape[-1] == 4
    scaled = RotaryPositionEmbedding(8, seq_len_interpolation_factor=2)(6)
    torch.testing.assert_close(scaled[4], RotaryPositionEmbedding(8)(6)[2])


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d_rot", [8, 4])
@pytest.mark.parametrize("offsets", [True, False], ids=["start_positions", "from_0"])
def test_rope_dense_matches_oracle(fmt, interleaved, d_rot, offsets):
    b, s, h, d = 3, 7, 2, 8
    x = torch.randn(b, s, h, d, dtype=torch.float64)
    start = torch.tensor([0, 3, 5]) if offsets else None
    table = RotaryPositionEmbedding(d_rot, interleaved=interleaved)(16).double()
    t = x.transpose(0, 1) if fmt == "sbhd" else x
    out = apply_rotary_pos_emb(t, table, fmt, start_positions=start, interleaved=interleaved)
    out = out.transpose(0, 1) if fmt == "sbhd" else out
    positions = torch.arange(s)[None] + (start[:, None] if offsets else 0)
    torch.testing.assert_close(out, oracle.rope(x, positions, d_rot, interleaved=interleaved))
    assert torch.equal(out[..., d_rot:], x[..., d_rot:])  # partial rotation passes the rest


def test_rope_thd_restarts_per_sequence():
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    x = torch.randn(10, 2, 8, dtype=torch.float64)
    table = RotaryPositionEmbedding(8)(16).double()
    start = torch.tensor([0, 2, 4])
    out = apply_rotary_pos_emb(x, table, "thd", cu_seqlens=cu, start_positions=start)
    for z in range(3):
        a, e = int(cu[z]), int(cu[z + 1])
        positions = torch.arange(e - a)[None] + start[z]
        want = oracle.rope(x[a:e][None], positions, 8)[0]
        torch.testing.assert_close(out[a:e], want)


def test_rope_dtype_and_errors():
    x = torch.randn(4, 1, 2, 8, dtype=torch.bfloat16)
    table = RotaryPositionEmbedding(8)(4)
    out = apply_rotary_pos_emb(x, table)
    assert out.dtype == torch.bfloat16
    want = oracle.rope(x.double().transpose(0, 1), torch.arange(4)[None], 8).transpose(0, 1)
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_pos_emb(x, table, start_positions=torch.tensor([1]))
    with pytest.raises(ValueError, match="RoPE table has 3 positions, position 3 requested"):
        apply_rotary_pos_emb(x, table[:3])  # dense from 0: the bound comes from the shape
    with pytest.raises(ValueError, match="cu_seqlens"):
        apply_rotary_pos_emb(x[:, 0], table, "thd")


@pytest.mark.parametrize("seed", range(6))
def test_rope_bound_check_computes_the_largest_position_on_the_host(seed):
    """thd (empty sequences, rows past the last sequence) and start offsets: the table bound is
    checked from host copies of cu_seqlens / start_positions, and must equal the largest of the
    positions the rotation gathers."""
    from fusedlayers.layers.rope import _largest_position, token_positions

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 6, (4,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    rows = int(cu[-1]) + int(torch.randint(0, 4, (1,), generator=g))  # trailing padding rows
    start = torch.randint(0, 9, (4,), generator=g)
    x = torch.randn(rows, 2, 8)
    for starts in (None, start):
        want = token_positions(x, "thd", cu, starts)
        want = int(want.max()) if want.numel() else -1
        assert _largest_position(x, "thd", cu, starts) == want
    dense = torch.randn(4, 5, 2, 8)  # bshd: b = 4
    want = int(token_positions(dense, "bshd", None, start).max())
    assert _largest_position(dense, "bshd", None, start) == want == 4 + int(start.max())
    table = RotaryPositionEmbedding(8)(max(want, 1))  # one position short of the largest
    with pytest.raises(ValueError, match=f"position {want} requested"):
        apply_rotary_pos_emb(dense, table, "bshd", start_positions=start)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_rope_from_position_0_compiles_without_graph_breaks(fmt):
    """Dense RoPE from position 0 reads nothing back from the tensors (on a GPU such a read is a
    sync per call), so the whole call traces into one graph."""
    x = torch.randn(2, 5, 2, 8, dtype=torch.float64)
    table = RotaryPositionEmbedding(8)(8).double()
    compiled = torch.compile(apply_rotary_pos_emb, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, table, fmt), apply_rotary_pos_emb(x, table, fmt))


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_norm_modules(cls, zero_centered_gamma):
    norm = cls(16, eps=1e-6, zero_centered_gamma=zero_centered_gamma, params_dtype=torch.float64)
    assert float(norm.weight.detach()[0]) == (0.0 if zero_centered_gamma else 1.0)
    with torch.no_grad():
        norm.weight.add_(torch.randn(16, dtype=torch.float64))
        if norm.bias is not None:
            norm.bias.add_(torch.randn(16, dtype=torch.float64))
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    want = oracle.norm(x, norm.weight, norm.bias, 1e-6, norm.normalization, zero_centered_gamma)
    torch.testing.assert_close(norm(x), want)
    names = {"weight", "bias"} if cls is LayerNorm else {"weight"}
    assert set(norm.state_dict()) == names


def test_norm_low_precision_computes_in_fp32():
    norm = RMSNorm(256, params_dtype=torch.bfloat16)
    x = torch.randn(8, 256, dtype=torch.bfloat16) * 30
    want = oracle.norm(x, norm.weight, None, 1e-5, "RMSNorm", False)
    err = (norm(x).double() - want).abs().max()
    assert norm(x).dtype == torch.bfloat16 and err <= 2**-7 * want.abs().max()


def test_linear_options():
    lin = Linear(8, 6, return_bias=True, params_dtype=torch.float64)
    with torch.no_grad():
        lin.bias.add_(1.0)
    x = torch.randn(2, 8, dtype=torch.float64)
    out, bias = lin(x)
    torch.testing.assert_close(out + bias, oracle.linear(x, lin.weight, lin.bias))
    split = Linear(8, 6, parameters_split=("key", "value"))
    assert [n for n, _ in split.named_parameters()] == [
        "key_weight",
        "key_bias",
        "value_weight",
        "value_bias",
    ]
    with pytest.raises(ValueError, match="split evenly"):
        Linear(8, 7, parameters_split=("key", "value"))
    with pytest.raises(ValueError, match="add up"):
        Linear(8, 6, parameters_split={"query": 4, "key": 1})


def test_layernorm_linear_outputs():
    lin = LayerNormLinear(
        8, 6, normalization="RMSNorm", return_layernorm_output=True, params_dtype=torch.float64
    )
    x = torch.randn(3, 8, dtype=torch.float64)
    out, ln = lin(x)
    want_ln = oracle.norm(x, lin.layer_norm_weight, None, lin.eps, "RMSNorm", False)
    torch.testing.assert_close(ln, want_ln)
    torch.testing.assert_close(out, oracle.linear(want_ln, lin.weight, lin.bias))
    assert lin.layer_norm_bias is None


def test_layernorm_mlp_return_options():
    mlp = LayerNormMLP(
        8,
        12,
        activation="geglu",
        return_bias=True,
        return_layernorm_output=True,
        params_dtype=torch.float64,
    )
    with torch.no_grad():
        mlp.fc2_bias.add_(0.5)
    x = torch.randn(3, 8, dtype=torch.float64)
    out, bias, ln = mlp(x)
    want, want_ln = oracle.mlp(mlp, x)
    torch.testing.assert_close(out + bias, want)
    torch.testing.assert_close(ln, want_ln)
