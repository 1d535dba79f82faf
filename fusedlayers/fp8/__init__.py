"""FP8 training, TransformerEngine's way (`transformer_engine.pytorch.fp8` / `.quantization`).

    autocast, fp8_autocast          run the GEMM modules' GEMMs in FP8 inside a block
    quantized_model_init, fp8_model_init
                                    build GEMM modules whose weights are kept in FP8 only
    is_fp8_available, check_fp8_support
                                    whether this GPU and torch run FP8 GEMMs, and why not

The pieces, bottom up: `scaling` (formats, scales, casts, the delayed-scaling update), `meta` (a
module's scales and amax histories in TE's layout), `extra_state` (their checkpoint entry),
`state` (what the context managers of `context` set; the end-of-step updates), `gemm` (the FP8
linear's forward and backward GEMMs), `_torch_compat` (the torch names that differ between
releases).
The recipes are `fusedlayers.recipe`. docs/fp8.md says what runs where.
"""

from .context import (
    autocast,
    check_fp8_support,
    fp8_autocast,
    fp8_model_init,
    is_fp8_available,
    quantized_model_init,
)

__all__ = [
    "autocast",
    "check_fp8_support",
    "fp8_autocast",
    "fp8_model_init",
    "is_fp8_available",
    "quantized_model_init",
]
