"""FP8 (float8_e4m3fn) attention forward on CUDA: the portable kernel's fp8 Q K^T dot and bf16
P V product against `attention_reference` in fp32 on the dequantized inputs.

Pass rule and inputs from tests/fp8_attention_testing.py: per (sequence, KV head) amax-quantized
inputs whose magnitudes differ across the batch and heads, so the descales are far from 1; the
kernel's max error is at most 2x that of the reference fed the dequantized inputs rounded to bf16,
plus one bf16 unit. Errors go to the junit report as properties. Dense and varlen, causal and not,
MHA/GQA/MQA, d = 64, 128, 256 and an odd pair, lengths that are no multiple of a tile; a CUDA graph
replayed with new descales (they are read on the device); the call compiled by torch.compile
(Inductor) through the forward op; the sm_90 path declining fp8; and GPUs below sm_89 refusing
fp8 with the compute capability named. Ported with the fp8 forward from wip-48 (312b848) onto
main's routes; on main it has not run on a GPU yet.

Shapes: dense q [b, s_q, h, d], k/v [b, s_k, h_kv, d(_v)]; varlen q [t_q, h, d]; descales
[b, h_kv].
"""

from __future__ import annotations

import logging

import pytest
import torch
from fp8_attention_testing import FP8, check_fp8, random_inputs, run_kernel
from fusedlayers.kernels import dispatch, set_forward_path

from fusedlayers import ArgumentError, flash_attn_func

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _fp8_gpu() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(
    not torch.cuda.is_available() or not _fp8_gpu(), reason="fp8 attention needs sm_89+"
)


def _record(record_property, errors):
    for name, (err, pt_err) in errors.items():
        record_property(f"{name}_error", f"{err:.3g}")
        record_property(f"{name}_pytorch_error", f"{pt_err:.3g}")


@needs_fp8
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dense(d, causal, record_property):
    """GQA 8:2, s_q != s_k, both odd and past one tile; bottom-right causal and full."""
    data = random_inputs(2, 257, 383, 8, 2, d, d, device=DEV, seed=d + causal)
    _record(record_property, check_fp8(data, torch.float32, causal=causal))


@needs_fp8
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen(d, causal, record_property):
    """Four sequences of random lengths (the first 300 queries / 513 keys), MQA 4:1."""
    data = random_inputs(4, 300, 513, 4, 1, d, d, device=DEV, seed=10 * d + causal, varlen=True)
    _record(record_property, check_fp8(data, torch.float32, causal=causal))


@needs_fp8
@pytest.mark.parametrize("d, d_v", [(80, 80), (40, 24), (192, 128)])
def test_other_head_dims(d, d_v, record_property):
    """Head dims between tile widths (masked loads) and d_v != d_qk; MHA, more queries than
    keys, so bottom-right causal leaves the first rows empty (output 0, LSE -inf)."""
    data = random_inputs(2, 131, 77, 4, 4, d, d_v, device=DEV, seed=d + d_v)
    _record(record_property, check_fp8(data, torch.float32, causal=True))


@needs_fp8
def test_windows_softcap_and_alibi(record_property):
    """The descales fold into the softmax scale: windows, softcap and ALiBi act on the
    dequantized scores."""
    data = random_inputs(2, 400, 600, 8, 2, 128, 128, device=DEV, seed=3)
    slopes = torch.linspace(0.01, 0.5, 8, device=DEV)
    errors = check_fp8(data, torch.float32, window_size=(96, 32), softcap=20.0, alibi_slopes=slopes)
    _record(record_property, errors)


@needs_fp8
def test_long_keys(record_property):
    """Several thousand keys: many blocks of the online softmax, each with the folded scale."""
    data = random_inputs(1, 1000, 4097, 16, 4, 128, 128, device=DEV, seed=4)
    _record(record_property, check_fp8(data, torch.float32, causal=True))


@needs_fp8
def test_sm90_path_pinned_still_runs_fp8_on_the_portable_kernel(caplog):
    """Pinned to the sm_90 path, an fp8 call still runs (the portable kernel) with the same bits,
    and on an sm_90 GPU the dispatcher logs why it declined."""
    data = random_inputs(2, 128, 2048, 4, 2, 128, 128, device=DEV, seed=5)
    portable = run_kernel(data, causal=True)
    previous = set_forward_path("sm90")
    try:
        with caplog.at_level(logging.DEBUG, logger="fusedlayers.kernels"):
            pinned = run_kernel(data, causal=True)
    finally:
        set_forward_path(previous)
    assert torch.equal(pinned[0], portable[0]) and torch.equal(pinned[1], portable[1])
    sm90 = dispatch.sm90_kernels("_flash_fwd_sm90")
    if torch.cuda.get_device_capability() == (9, 0) and sm90.GLUON_AVAILABLE:
        messages = [r.getMessage() for r in caplog.records]
        assert any("fp8 (float8_e4m3fn) inputs" in m for m in messages), messages


@needs_fp8
def test_captured_call_reads_descales_on_the_device():
    """A CUDA graph of an fp8 call replays with new descale values written in place: they are
    read by the kernel, not on the host at capture."""
    data = random_inputs(2, 200, 300, 8, 2, 128, 128, device=DEV, seed=6)
    q, k, v = data["q8"], data["k8"], data["v8"]
    descales = {f"{n}_descale": data[f"{n}_descale"].clone() for n in "qkv"}

    def step():
        return flash_attn_func(q, k, v, causal=True, **descales)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for factor in (0.5, 3.0):
        for name in "qkv":
            descales[f"{name}_descale"].copy_(data[f"{name}_descale"] * factor)
        graph.replay()
        torch.testing.assert_close(out, step(), rtol=0, atol=0)
    # The replay equals an eager call with the last descales (above); that call by the pass rule,
    # on inputs whose dequantized values grew by the same factor.
    scaled = {**data}
    for n in "qkv":
        scaled[f"{n}_descale"] = data[f"{n}_descale"] * 3.0
        scaled[f"{n}_deq"] = data[f"{n}_deq"] * 3.0
    check_fp8(scaled, torch.float32, causal=True)


@needs_fp8
def test_compiled_call_matches_eager():
    """torch.compile (Inductor, fullgraph) takes the fp8 call through the forward op, descales
    as its last argument: the same bits as the eager bare launch."""
    from fusedlayers.kernels import flash_attention

    data = random_inputs(2, 150, 260, 8, 2, 128, 128, device=DEV, seed=7)
    qkv = data["q8"], data["k8"], data["v8"]
    descales = [data[f"{n}_descale"] for n in "qkv"]

    def attend(q, k, v, q_descale, k_descale, v_descale):
        return flash_attention(
            q, k, v, softmax_scale=128**-0.5, window_size=(-1, 0), q_descale=q_descale,
            k_descale=k_descale, v_descale=v_descale,
        )  # fmt: skip

    eager = attend(*qkv, *descales)
    compiled = torch.compile(attend, fullgraph=True)(*qkv, *descales)
    assert compiled[0].dtype == torch.bfloat16
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


@pytest.mark.skipif(not torch.cuda.is_available() or _fp8_gpu(), reason="needs a GPU below sm_89")
def test_gpus_below_sm89_refuse_fp8():
    q = torch.randn(1, 16, 2, 64, device=DEV).to(FP8)
    with pytest.raises(ArgumentError, match=r"float8_e4m3fn.*compute capability \d\.\d"):
        flash_attn_func(q, q, q)
