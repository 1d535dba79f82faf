"""What a caller of the flash-attn functions meets when a call is wrong, and the Triton
interpreter as a new user on a CPU meets it.

- Argument errors are `ArgumentError`: catchable as `ValueError` (TE, Python) and as
  `RuntimeError` (what flash-attn's kernels raise), worded with the caller's argument names.
- bf16 under the interpreter computes in fp32 (its bf16 `tl.dot` is wrong), so it is correct.
- `TRITON_INTERPRET=1` set after the import, or not at all, gets a message that says what to do.
"""

import os
import subprocess
import sys

import pytest
import torch
from attention_testing import Case, check_case
from fusedlayers.kernels import _compat
from kvcache_testing import KVCase, check_kv_case

import fusedlayers
from fusedlayers import ArgumentError, flash_attn_func, flash_attn_with_kvcache

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not _compat.INTERPRETER,
    reason="the Triton interpreter on CPU tensors",
)


def _qkv(d=16, dtype=torch.float16, s=5):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, s, 2, d, generator=g).to(dtype) for _ in range(3)]


def test_argument_error_is_value_and_runtime_error():
    error = ArgumentError("x")
    assert isinstance(error, ValueError) and isinstance(error, RuntimeError)
    assert isinstance(fusedlayers.ArgumentTypeError("x"), TypeError)
    assert issubclass(fusedlayers.ArgumentTypeError, ArgumentError)


@needs_interpreter
@pytest.mark.parametrize(
    "call, words, not_words",
    [
        (
            lambda q, k, v: flash_attn_func(q, k, v, dropout_p=1.5),
            "dropout_p=1.5",
            "attention_dropout",
        ),
        (lambda q, k, v: flash_attn_func(q[0], k, v), "q must be 4-D", "query_layer"),
        (lambda q, k, v: flash_attn_func(q, k.float(), v), "k dtype torch.float32", "key_layer"),
        (
            lambda q, k, v: flash_attn_func(q, *(t[:, :, :1].expand(2, 5, 3, 16) for t in (k, v))),
            "q/k",
            "query_layer",
        ),
    ],
    ids=["dropout", "rank", "dtype", "heads"],
)
def test_flash_attn_errors_use_flash_attn_names(call, words, not_words):
    """Fails on the TE-worded messages (`attention_dropout=1.5`, `query_layer must be 4-D`)."""
    q, k, v = _qkv()
    with pytest.raises(RuntimeError) as raised:  # flash-attn's exception type
        call(q, k, v)
    assert isinstance(raised.value, ValueError)
    message = str(raised.value)
    assert words in message and not_words not in message, message


@needs_interpreter
def test_flash_attn_head_dim_beyond_kernels_points_at_the_reference():
    """flash_attn_func has no `use_reference`: the hint names what it can call instead."""
    q, k, v = _qkv(d=512)
    with pytest.raises(ArgumentError, match="512") as raised:
        flash_attn_func(q, k, v)
    assert "use_reference" not in str(raised.value)
    assert "attention_reference" in str(raised.value)


@needs_interpreter
@pytest.mark.parametrize("append", [False, True])
def test_paged_cache_overflow_names_block_table(append):
    """flash-attn's contract: a paged cache that `block_table` cannot address raises a
    RuntimeError naming block_table; a call exactly at capacity runs."""
    page, d = 16, 16
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(4, page, 1, d, generator=g).half() for _ in range(2))
    table = torch.zeros(1, 1, dtype=torch.int32)
    q = torch.randn(1, 1, 1, d, generator=g).half()
    new = [torch.randn(1, 1, 1, d, generator=g).half() for _ in range(2)] if append else [None] * 2
    lengths = torch.full((1,), page if append else page + 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(
            q, k_cache, v_cache, k=new[0], v=new[1], cache_seqlens=lengths, block_table=table
        )
    full = torch.full((1,), page, dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=full, block_table=table)
    assert out.shape == q.shape and torch.isfinite(out).all()


@needs_interpreter
@pytest.mark.parametrize(
    "case",
    [
        Case(dtype=torch.bfloat16),
        Case(dtype=torch.bfloat16, h=4, h_kv=2, window=(-1, 0), layout="varlen"),
    ],
    ids=lambda c: c.label(),
)
def test_bf16_under_the_interpreter_is_correct(case):
    """The interpreter's bf16 dot returns values of ~1e8 from N(0, 1) inputs; the kernels
    compute bf16 in fp32 there, so forward and gradients pass the 2x rule."""
    check_case(case, "cpu")


@needs_interpreter
def test_bf16_decode_under_the_interpreter_is_correct():
    check_kv_case(KVCase(dtype=torch.bfloat16, s_new=1, page_size=16), "cpu")


def _run_python(code: str, interpret: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


_CALL_ON_CPU = """
import os, torch
import fusedlayers
{before}
q = torch.randn(1, 4, 1, 16, dtype=torch.float16)
try:
    fusedlayers.flash_attn_func(q, q, q)
except Exception as error:
    print(type(error).__name__, "|", error)
else:
    print("ran")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_interpreter_set_after_import_says_so():
    """Before: Triton's `RuntimeError: 0 active drivers ([])`, with no word of the cause."""
    done = _run_python(_CALL_ON_CPU.format(before='os.environ["TRITON_INTERPRET"] = "1"'), None)
    assert "ArgumentError" in done.stdout, done.stdout + done.stderr
    assert "after fusedlayers was imported" in done.stdout
    assert "before Python starts" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_kernels_on_cpu_without_interpreter_say_how():
    done = _run_python(_CALL_ON_CPU.format(before=""), None)
    assert "ArgumentError" in done.stdout and "need CUDA tensors, got q on cpu" in done.stdout
    assert "export TRITON_INTERPRET=1 before Python starts" in done.stdout
    ran = _run_python(_CALL_ON_CPU.format(before=""), "1")
    assert ran.stdout.strip() == "ran", ran.stdout + ran.stderr
