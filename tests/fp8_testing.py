"""Helpers of the FP8 tests: error bounds from the formats' precision, a recorder of the casts the
GEMMs make, and the per-rank body of the amax-reduction test.

The bound of a product `a @ b^T` whose operands were cast with elementwise errors `ea`, `eb` is

    |out - a @ b^T| <= ea @ |b|^T + |a| @ eb^T + ea @ eb^T  (+ fp32 accumulation)

and a cast's error is half a unit in the last place: `|t| * 2^-(m+1)` for normal values (m
mantissa bits), and half the subnormal step divided by the scale below the normal range.
"""

from __future__ import annotations

import torch

from fusedlayers.fp8 import gemm as fp8_gemm

# (mantissa bits, smallest normal exponent) of the FP8 formats
FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def cast_error(t: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Elementwise bound on |cast(t) - t| for a cast to `dtype` with `scale` (no saturation)."""
    mantissa, emin = FORMATS[dtype]
    t = t.double().abs()
    relative = t * 2.0 ** -(mantissa + 1)
    subnormal = torch.full_like(t, 2.0 ** (emin - mantissa - 1) / float(scale))
    return torch.maximum(relative, subnormal) * (1 + 1e-6)  # + the fp32 scaling's rounding


def gemm_bound(a, ea, b, eb) -> torch.Tensor:
    """Bound on |fp8 product - a @ b^T| (module docstring), fp32 accumulation included."""
    a, b = a.double().abs(), b.double().abs()
    exact = a @ b.t()
    return ea @ b.t() + a @ eb.t() + ea @ eb.t() + 1e-5 * exact + 1e-30


def current_scale(t: torch.Tensor, dtype: torch.dtype) -> float:
    """Current scaling's scale for t: the format's max over t's amax."""
    return torch.finfo(dtype).max / t.abs().max().item()


def assert_within(got, want, bound, what: str) -> float:
    """Every element of |got - want| within `bound`; returns the largest error, for checks that
    FP8 was really applied (an exact product would be far below the bound)."""
    err = (got.double() - want.double()).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, (
        f"{what}: error {err.max().item():.3g} exceeds its FP8 bound ({worst:.2f}x)"
    )
    return err.max().item()


class CastRecorder:
    """Counts and records (role, FP8 dtype) of every cast the GEMMs make, by wrapping
    `fusedlayers.fp8.gemm.cast` (install with monkeypatch)."""

    def __init__(self) -> None:
        self.casts: list[tuple[str, torch.dtype]] = []
        self._cast = fp8_gemm.cast

    def __call__(self, t, role, plan, record=True):
        q = self._cast(t, role, plan, record)
        self.casts.append((role, q.data.dtype))
        return q

    def install(self, monkeypatch) -> CastRecorder:
        monkeypatch.setattr(fp8_gemm, "cast", self)
        return self

    def count(self, role: str) -> int:
        return sum(r == role for r, _ in self.casts)

    def dtypes(self, role: str) -> set[torch.dtype]:
        return {d for r, d in self.casts if r == role}


def amax_reduction_rank(rank: int, world: int, reduce_amax: bool, new_group: bool) -> dict:
    """One delayed-scaling step on a Linear whose input is scaled by rank + 1; returns this
    rank's scales and input amax (run by `distributed_testing.run_on_ranks`)."""
    import torch.distributed as dist

    import fusedlayers as te
    from fusedlayers import recipe

    torch.manual_seed(0)
    layer = te.Linear(32, 16, use_reference=True)
    torch.manual_seed(100 + rank)
    x = torch.randn(16, 32) * (rank + 1)
    dy = torch.randn(16, 16) * (rank + 1)
    group = dist.new_group(list(range(world))) if new_group else None
    r = recipe.DelayedScaling(amax_history_len=2, reduce_amax=reduce_amax)
    with te.fp8_autocast(fp8_recipe=r, fp8_group=group):
        out = layer(x)
    out.backward(dy)
    meta = layer.fp8_meta
    return {
        "scale_fwd": meta.scale_fwd.tolist(),
        "scale_bwd": meta.scale_bwd.tolist(),
        "amax_x": x.abs().max().item(),
        "amax_w": layer.weight.detach().abs().max().item(),
        "amax_dy": dy.abs().max().item(),
    }
