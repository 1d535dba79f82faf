"""tests/test_repeat_calls.py on a GPU: the same sequences of repeated and interleaved calls in
fp16 and bf16, at the small signatures (portable kernels) and at lengths that "auto" sends to
the sm_90 kernels on a Hopper GPU. The oracle is the fp32 reference."""

from __future__ import annotations

import pytest
import torch
from repeat_testing import SEQUENCES
from test_repeat_calls import (
    KV_ORDERS,
    PATHS,
    SIGNATURES,
    Signature,
    check_kvcache_repeats,
    check_repeats,
)

pytestmark = pytest.mark.gpu

LONG = {
    "A": Signature(1, 1024, 1024, 4, 2, 128, causal=True),
    "B": Signature(2, 2048, 2048, 2, 2, 64, causal=False, seed=1),
}


@pytest.mark.parametrize("order", SEQUENCES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("signatures", [SIGNATURES, LONG], ids=["short", "long"])
def test_repeated_calls_gpu(path, order, dtype, signatures):
    check_repeats(path, order, "cuda", dtype, signatures)


@pytest.mark.parametrize("order", KV_ORDERS)
def test_kvcache_repeated_calls_gpu(order):
    check_kvcache_repeats(order, "cuda")
