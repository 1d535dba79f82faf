"""Every torch name the FP8 path uses that differs between torch releases, in one place.

- The FP8 dtypes `torch.float8_e4m3fn` and `torch.float8_e5m2` (torch 2.1+).
- `torch.ops.aten._unsafe_view`, a reshape whose result is not a view.
- `torch.is_autocast_enabled(device_type)` / `torch.get_autocast_dtype(device_type)` (2.4+).
- `torch._scaled_mm`, the cuBLASLt FP8 GEMM. Its schema as of torch 2.4 to 2.13:

      _scaled_mm(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                 use_fast_accum=False) -> Tensor

  mat1 `[M, K]` row-major, mat2 `[K, N]` column-major (the transpose of a contiguous `[N, K]`),
  FP8 both (never E5M2 x E5M2), K and N multiples of 16; `scale_a`/`scale_b` are fp32
  one-element tensors that *dequantize* (`out = (mat1 * scale_a) @ (mat2 * scale_b)`); `bias`
  must have the output dtype. Releases before 2.4 returned `(out, amax)`; `scaled_mm` below
  takes either. torch 2.10+ also has `torch.nn.functional.scaled_mm` with blockwise scaling
  types; fusedlayers does not call it yet (block scaling is dequantized, see `gemm.py`).

Written against torch 2.13's schema and checked there on the CPU (the schema, the dtypes); the
CUDA call itself runs only in the GPU tests (tests/gpu/test_fp8_gpu.py).
"""

from __future__ import annotations

import torch

E4M3 = getattr(torch, "float8_e4m3fn", None)
E5M2 = getattr(torch, "float8_e5m2", None)
HAS_FP8_DTYPES = E4M3 is not None and E5M2 is not None
HAS_SCALED_MM = hasattr(torch, "_scaled_mm")


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer computes in: torch.autocast's for x's device type when it is on
    (`torch.is_autocast_enabled(device_type)`, torch 2.4+), else x's own."""
    device_type = x.device.type
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        pass
    return x.dtype


def unviewed_reshape(t: torch.Tensor, shape) -> torch.Tensor:
    """`t.view(shape)` that is not marked a view (`aten::_unsafe_view`, what `F.linear` returns
    for 3-D inputs): FSDP2 warns about modules whose output is a view, since an in-place op on it
    would skip its backward hook. For a `t` nothing else refers to."""
    unsafe_view = getattr(torch.ops.aten, "_unsafe_view", None)
    return t.view(shape) if unsafe_view is None else unsafe_view(t, shape)


def scaled_mm(
    a: torch.Tensor,
    b_t: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """`(a * scale_a) @ (b_t * scale_b) (+ bias)` on cuBLASLt: a `[M, K]` row-major FP8, b_t
    `[K, N]` column-major FP8, scales fp32 with one element (dequantizing), out `[M, N]`."""
    out = torch._scaled_mm(
        a, b_t, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum
    )
    return out[0] if isinstance(out, tuple) else out


__all__ = [
    "E4M3", "E5M2", "HAS_FP8_DTYPES", "HAS_SCALED_MM", "activation_dtype", "scaled_mm",
    "unviewed_reshape",
]  # fmt: skip
