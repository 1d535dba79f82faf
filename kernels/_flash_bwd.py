"""Flash-attention backward: the preprocess kernel, the block-size table and the launcher.

Shapes (see docs/internals.md):
    dense  q/dq [b, s_q, h_q, d_qk], k/dk [b, s_k, h_kv, d_qk], v/dv [b, s_k, h_kv, d_v],
           out/dout [b, s_q, h_q, d_v], lse [b, h_q, s_q]
    varlen q/dq [t_q, h_q, d_qk], k/dk [t_k, h_kv, d_qk], v/dv [t_k, h_kv, d_v],
           out/dout [t_q, h_q, d_v], lse [h_q, t_q]
    dbias [b, h_q, s_q, s_k] (varlen: b sequences, max lengths, positions within each sequence)

Two schemes, both reading delta = rowsum(dO * O) (fp32), minus the LSE's upstream gradient dlse
when the loss reads the LSE (`_common.delta_minus_dlse`: that is the whole of the LSE's gradient):

- Two-pass (`deterministic=True`, or whenever dBias is requested): the preprocess, dK/dV (one
  program per key block and KV head, looping over the GQA group's query heads), then dQ (one
  program per query block and head). Nothing is accumulated with atomics, so the gradients are
  bitwise identical run to run. The dQ pass recomputes Q K^T and dO V^T: 7 block products per
  tile pair. Up to `DELTA_IN_DQ_MAX_LEN` keys and queries, where the host's time bounds the
  call, the dQ pass computes delta itself and runs first: two launches instead of three.
- Atomic dQ (`deterministic=False`, no dBias, where `ATOMIC_DQ_DEVICES` allows; off until it is
  measured on the H100): the preprocess computes delta, then the
  dK/dV kernel also adds dS^T K into a zero-filled fp32 dQ accumulator with atomics
  (FlashAttention-2's scheme), and one elementwise pass scales and casts it: 5 block products.
  dK/dV stay bitwise reproducible; dQ does not, as the order of the fp32 adds varies.

On an sm_90 GPU, non-deterministic calls the Hopper kernel covers can instead take it
(`dispatch`, `_flash_bwd_sm90.py`): one warp-specialized launch (TMA, wgmma) for dQ, dK
and dV after the same preprocess, dQ summed with atomics as in the atomic-dQ scheme.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _common
from ._common import (
    MAX_PLANS,
    LaunchGeometry,
    attention_signature,
    causal_order_heads,
    cdiv,
    delta_minus_dlse,
    dim_mask,
    empty,
    head_row_bytes,
    launch_geometry,
    load_tile,
    lse_strides,
    multiprocessors,
    next_pow2_dim,
    remember,
    seq_bounds,
    shape_only_geometry,
    smem_per_block,
    strides4,
    zeros,
)
from ._flash_bwd_dkdv import _flash_bwd_dkdv_kernel
from ._flash_bwd_dq import _flash_bwd_dq_kernel
from ._launch import PlannedLaunch, call_signature, launch_planned, launch_slot
from .dispatch import backward_path, sm90_backward_plan, sm90_kernels


@triton.jit
def _flash_bwd_preprocess_kernel(
    OUT, DO, DELTA, LSE, DLSE, DQ_ACC, CU_Q, OFF_Q, LENS_Q,
    stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh, stride_ls, stride_ab, stride_as, stride_ah, H_Q, MAX_Q, D_QK, D_V,
    BLOCK_M: tl.constexpr, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    PAD_QK: tl.constexpr, PAD_V: tl.constexpr, SEQ_MODE_Q: tl.constexpr, ZERO_DQ: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """delta[z, h, i] = sum_d dO[i, h, d] * O[i, h, d] in fp32, laid out like the LSE (minus
    DLSE[z, h, i], laid out the same way, with HAS_DLSE; LSE and DLSE read only then); with
    ZERO_DQ also the same rows of the fp32 dQ accumulator DQ_ACC (strides `stride_a*`) set to 0,
    so the schemes that sum dQ with atomics need no separate fill of it. Short two-pass calls
    skip it: their dQ pass computes delta (`DELTA_IN_DQ_MAX_LEN`).

    Grid: (cdiv(MAX_Q, BLOCK_M) * batch * H_Q,). Rows past the sequence are left unwritten (the
    launcher zero-fills the accumulator itself when some rows belong to no sequence).
    """
    num_m = tl.cdiv(MAX_Q, BLOCK_M)
    pid_zh = tl.program_id(0) // num_m
    z = (pid_zh // H_Q).to(tl.int64)
    h = (pid_zh % H_Q).to(tl.int64)
    start_q, len_q = seq_bounds(z, CU_Q, OFF_Q, LENS_Q, MAX_Q, SEQ_MODE_Q)
    offs_m = (tl.program_id(0) % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_V)
    row_ok = offs_m < len_q
    rows = start_q.to(tl.int64) + offs_m
    d_ok = dim_mask(offs_d, D_V, PAD_V)
    o_ptrs = OUT + z * stride_ob + h * stride_oh + rows[:, None] * stride_os + offs_d[None, :]
    o = load_tile(o_ptrs, row_ok, d_ok, True, PAD_V, 0).to(tl.float32)
    do_ptrs = DO + z * stride_dob + h * stride_doh + rows[:, None] * stride_dos + offs_d[None, :]
    do = load_tile(do_ptrs, row_ok, d_ok, True, PAD_V, 0).to(tl.float32)
    lse_at = z * stride_lb + h * stride_lh + rows * stride_ls
    delta = tl.sum(o * do, axis=1)
    if HAS_DLSE:
        lse = tl.load(LSE + lse_at, mask=row_ok, other=0.0)
        delta = delta_minus_dlse(delta, lse, tl.load(DLSE + lse_at, mask=row_ok, other=0.0))
    tl.store(DELTA + lse_at, delta, mask=row_ok)
    if ZERO_DQ:
        offs_k = tl.arange(0, HEAD_DIM_QK)
        acc_ptrs = DQ_ACC + z * stride_ab + h * stride_ah + rows[:, None] * stride_as
        acc_ok = row_ok[:, None] & dim_mask(offs_k, D_QK, PAD_QK)[None, :]
        zeros = tl.zeros([BLOCK_M, HEAD_DIM_QK], dtype=tl.float32)
        tl.store(acc_ptrs + offs_k[None, :], zeros, mask=acc_ok)


# Launch shapes per padded head dim (the larger of d_qk and d_v): the one place to tune.
# dK/dV pass (suffix 1): BLOCK_N1 keys stay resident while BLOCK_M1 query rows stream past.
# dQ pass (suffix 2): BLOCK_M2 query rows stay resident while BLOCK_N2 keys stream past.
CONFIG_FIELDS = ("BLOCK_M1", "BLOCK_N1", "WARPS1", "STAGES1", "BLOCK_M2", "BLOCK_N2", "WARPS2",
                 "STAGES2")  # fmt: skip
# Every entry must pass tests/gpu/test_backward_gpu.py, its determinism test included: with
# query-major dK/dV tiles, (32, 128, 8, 3, ...) gave run-to-run different, wrong dK under Triton 3.6
# on the H100 (a miscompile; no kernel writes memory another program reads). The entries won
# `examples/perf/tune_attention.py --bwd` (each pass swept with the other at its entry; b=16384/s,
# h=2048/d, s=4096, causal and not, bf16, H100), re-swept on 2026-11-23 (code aaad225,
# bench/h100-2026-11-23e/tune-bwd-4k.log) after the passes' int32 row indices ended the dK/dV
# spills; backward ms, non-causal / causal:
# - d=128: dK/dV (32, 64, 4, 3) 3.39 / 2.03 against FlexAttention's (64, 128, 8, 3) 3.57 / 2.16
#   and (64, 128, 8, 2) 3.80 / 2.08; dQ (128, 64, 8, 3) against (128, 64, 8, 2) 3.93 / 2.21.
# - d=64: dK/dV (32, 128, 4, 3) 4.00 / 2.29 against (64, 64, 4, 3) 3.94 / 2.46; dQ (128, 64, 4, 3)
#   3.76 / 2.24 against (64, 64, 4, 3) 4.04 / 2.22. (64, 128, 4, 3) spills badly: 14.8 ms.
# - d=160-256, one entry (H200, 2026-11-28, code eaf0db4, bench/h200-2026-11-28/tune-bwd-wide.log;
#   forward+backward in bench/attention-head-dims-wide.json):
#   dQ (128, 32, 8, 2) 1.25-1.39x faster than the old (64, 32, 8, 2) at each of 160, 192 and 256,
#   causal and not; dK/dV (64, 64, 8, 2) 1.14x at 256, within 3% of the best at 160 and 192.
BWD_CONFIGS: dict[int, tuple[int, ...]] = {
    64: (32, 128, 4, 3, 128, 64, 4, 3),
    128: (32, 64, 4, 3, 128, 64, 8, 3),
    256: (64, 64, 8, 2, 128, 32, 8, 2),
}
# Causal-like launches (a right window bound) on sequences up to SHORT_SEQLEN (the longer of
# max_len_q and max_len_k) take these entries: with few key blocks per sequence, smaller blocks
# spread the mask's uneven work over more programs. `tune_attention.py --bwd --seqlen 1024`
# (b=16, H100, 2026-11-23; d=64 re-swept in bench/h100-2026-11-23e/tune-bwd-1k.log),
# causal ms: d=64 dK/dV (32, 64, 4, 3) 0.81 against the main entry's (32, 128, 4, 3) 0.81 (a tie
# since the int32 row indices; 0.99 against 1.15 before them), dQ (64, 64, 4, 3) 0.81 against
# 0.88. At d=128 the short entry (32, 128, 8, 3) had won before the int32 row indices (0.93
# against 0.98); since them the main entry is faster (0.75 against 0.81), so d=128 uses it.
# Non-causal launches gained 0-2% or lost up to 2% here, within the noise, so they keep the main
# table; at s=4096 the d=64 entries measured 1.5-2.4% slower (causal), hence the length bound.
SHORT_SEQLEN = 1024
# Two-pass launches on sequences up to this length (the longer of max_len_q and max_len_k)
# compute delta in the dQ pass, which then runs before the dK/dV pass, instead of in a
# preprocess launch: one launch less, where the host's time bounds the call. Backward GPU time
# on the H100 (bf16, 16k tokens, h * d = 2048) against the preprocess: 0.94-1.01x at s = 1k;
# 1.01-1.06x at 4k, where the unchanged path read 0.98-1.05x in the next process, so longer
# calls keep the preprocess until that is resolved (docs/performance.md, "Delta in the dQ pass").
DELTA_IN_DQ_MAX_LEN = 1024
BWD_SHORT_CONFIGS: dict[int, tuple[int, ...]] = {
    64: (32, 64, 4, 3, 64, 64, 4, 3),
    128: BWD_CONFIGS[128],
    256: BWD_CONFIGS[256],
}
# The interpreter runs one program at a time: small tiles keep it quick and make the tiny test
# shapes span several blocks, so block edges and the skipped/unmasked block ranges are exercised.
INTERPRETER_CONFIG = (16, 16, 4, 1, 16, 16, 4, 1)
PREPROCESS_BLOCK_M = 64

# The atomic-dQ path's dK/dV launch, (BLOCK_M1, BLOCK_N1, WARPS1, STAGES1) per padded head dim: the
# kernel also holds a [BLOCK_M, d_qk] dQ tile and issues its atomics. Every entry must pass
# tests/gpu/test_backward_gpu.py. `tune_attention.py --atomic` (s=4096, H100, 2026-11-23; commit
# history), ms non-causal / causal, against the two-pass backward's 3.68 / 2.25
# (d=128) and 4.47 / 2.59 (d=64): d=128 (64, 128, 8, 3) 4.00 / 3.26 (the two-pass dK/dV tile:
# 6.23 / 3.92); d=64 (64, 128, 8, 3) 4.86 / 3.05. Still slower, so the path stays off.
ATOMIC_CONFIG_FIELDS = CONFIG_FIELDS[:4]
BWD_ATOMIC_CONFIGS: dict[int, tuple[int, ...]] = {
    64: (64, 128, 8, 3),
    128: (64, 128, 8, 3),
    256: (32, 64, 8, 2),
}
# Where the non-deterministic backward takes the atomic-dQ path: "never" (the default until
# examples/perf/bench_backward.py shows it faster on the H100 and tests/gpu/test_backward_gpu.py
# passes it there; docs/performance.md), "cuda" (the interpreter runs one program at a time, so
# atomics save nothing there) or "any" (tests force it on the interpreter). deterministic=True and
# dBias always take the two-pass path.
ATOMIC_DQ_DEVICES = "never"
# The dK/dV pass splits a GQA group over several programs while it launches fewer than this
# many waves of programs (`group_splits`), (causal-like, other) launches; GROUP_SPLITS_OVERRIDE
# forces a split count (tests, the interpreter and benchmarks; None = decide by the waves).
# Measured on the H100 (GQA 32:1, b=4, s=4096, d=128, 256 programs, forward+backward): causal
# 7.39 -> 5.97 ms split in 3; non-causal, whose programs carry equal work, 9.79 -> 10.12 ms.
MIN_DKDV_WAVES = (4, 1)
GROUP_SPLITS_OVERRIDE: int | None = None


def _bucket(table: dict, head_dim: int) -> int:
    """The table key serving a head dim: the smallest bound >= head_dim."""
    for bound in sorted(table):
        if head_dim <= bound:
            return bound
    raise ValueError(f"head dim ({head_dim}) exceeds the largest supported ({max(table)})")


def _table_entry(table: dict, fields: tuple, head_dim: int, on_cuda: bool) -> dict[str, int]:
    """The launch shape for a head dim: its bucket's entry (interpreter: its own)."""
    if not on_cuda:
        return dict(zip(fields, INTERPRETER_CONFIG))
    return dict(zip(fields, table[_bucket(table, head_dim)]))


def bwd_table(max_len: int, causal: bool) -> dict[int, tuple[int, ...]]:
    """The two-pass launch table for sequences up to `max_len` (longer of queries and keys) and
    a causal-like mask (a right window bound) or not."""
    return BWD_SHORT_CONFIGS if causal and max_len <= SHORT_SEQLEN else BWD_CONFIGS


def bwd_config(
    head_dim: int, on_cuda: bool, max_len: int, causal: bool, elem_size: int = 2,
    smem_bytes: int | None = None, bias_elem_size: int = 0,
) -> dict[str, int]:  # fmt: skip
    """Block sizes, warps and pipeline stages of both passes for a head dim (max of d_qk, d_v),
    the longest query or key sequence and a causal-like mask or not. The tables are tuned for
    16-bit inputs without a bias; with `smem_bytes` (the device's shared memory per block) the
    tiles shrink to fit it where fp32 inputs (`elem_size` 4: 288 KiB at d = 96 on an H200, which
    has 227) or a bias (`bias_elem_size`, one score tile per stage: an fp32 bias took bf16 at
    d = 96 to 256 KiB) overrun it."""
    cfg = _table_entry(bwd_table(max_len, causal), CONFIG_FIELDS, head_dim, on_cuda)
    if smem_bytes is not None:
        cfg = fit_shared_memory(cfg, next_pow2_dim(head_dim), elem_size, smem_bytes,
                                bias_elem_size)  # fmt: skip
    return cfg


# Each pass of the two-pass backward: (the resident tile's rows, the streamed tile's rows, its
# pipeline stages).
_PASS_TILES = (("BLOCK_N1", "BLOCK_M1", "STAGES1"), ("BLOCK_M2", "BLOCK_N2", "STAGES2"))


def pass_shared_memory(
    cfg: dict, tiles: tuple, head_dim: int, elem_size: int, bias_elem_size: int = 0
) -> int:
    """A rough bound of one pass's shared memory: two resident [rows, head_dim] tiles (k and v,
    or q and dO), two streamed ones per pipeline stage and, with a bias, its [rows, rows] score
    tile per stage."""
    resident, streamed, stages = (cfg[name] for name in tiles)
    operands = 2 * head_dim * elem_size * (resident + stages * streamed)
    return operands + stages * resident * streamed * bias_elem_size


def fit_shared_memory(
    cfg: dict, head_dim: int, elem_size: int, limit: int, bias_elem_size: int = 0
) -> dict[str, int]:
    """`cfg` with each pass's tiles shrunk until `pass_shared_memory` fits `limit`: fewer stages
    first, then the resident tile, then the streamed one, never below 16 rows (the smallest tile
    `tl.dot` takes)."""
    cfg = dict(cfg)
    for tiles in _PASS_TILES:
        resident, streamed, stages = tiles
        while pass_shared_memory(cfg, tiles, head_dim, elem_size, bias_elem_size) > limit:
            if cfg[stages] > 1:
                cfg[stages] -= 1
            elif cfg[resident] > 16:
                cfg[resident] //= 2
            elif cfg[streamed] > 16:
                cfg[streamed] //= 2
            else:
                break
    return cfg


def bwd_atomic_config(head_dim: int, on_cuda: bool) -> dict[str, int]:
    """Block sizes, warps and stages of the atomic-dQ path's single dK/dV(+dQ) launch."""
    return _table_entry(BWD_ATOMIC_CONFIGS, ATOMIC_CONFIG_FIELDS, head_dim, on_cuda)


def use_atomic_dq(q: torch.Tensor, deterministic: bool, dbias_requested: bool) -> bool:
    """Whether the backward sums dQ with atomics (see ATOMIC_DQ_DEVICES)."""
    if deterministic or dbias_requested or ATOMIC_DQ_DEVICES == "never":
        # dBias is written by the dQ pass, the one program that owns each score element.
        return False
    return q.is_cuda or ATOMIC_DQ_DEVICES == "any"


def _new_grad(
    like: torch.Tensor, owns_all_rows: bool, given: torch.Tensor | None = None
) -> torch.Tensor:
    """The gradient buffer for `like`: `given` (the caller's, any strides with stride(-1) == 1)
    or a new contiguous one. Rows no sequence owns are never written, so zero them."""
    if given is None:
        if owns_all_rows:
            return empty(like.shape, like.dtype, like.device)
        return zeros(like.shape, like.dtype, like.device)
    return given if owns_all_rows else given.zero_()


class BackwardPlan(NamedTuple):
    """What the backward's launches derive from a call's signature (`_launch.call_signature`
    plus the settings below), computed once per signature by `_make_plan`. Per call there is
    left: allocating, and handing the tensors, seed and offset to the launches."""

    sm90: bool  # the sm_90 kernel takes the call (`dispatch.sm90_backward_plan`)
    pointers: operator.itemgetter  # (cu_q, cu_k, off_q, off_k, lens_q, lens_k, stand-in) -> 6
    geometry: LaunchGeometry | None  # `shape_only_geometry`: the sm_90 launch's, where it holds
    owns_q: bool  # every row of q / k belongs to a sequence (else gradients start at 0)
    owns_k: bool
    atomic: bool  # dQ summed with atomics in the dK/dV pass (`use_atomic_dq`)
    dq_width: int  # the dQ accumulator's columns a head: d_qk, or the sm_90 tiles' width
    delta_in_dq: bool  # the two-pass dQ pass computes delta and runs first (`DELTA_IN_DQ_MAX_LEN`)
    splits: int  # programs per GQA group in the dK/dV pass (`group_splits`)
    dbias_shape: tuple[int, ...] | None
    preprocess: PlannedLaunch
    dkdv: PlannedLaunch
    dq: PlannedLaunch


# Plans by (signature, settings); bounded by `remember`.
_PLANS: dict[tuple, BackwardPlan] = {}


def flash_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    seq_offsets_q: torch.Tensor | None = None,
    seq_offsets_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqlens_q: torch.Tensor | None = None,
    seqlens_k: torch.Tensor | None = None,
    softmax_scale: float,
    window_left: int = -1,
    window_right: int = -1,
    bottom_right: bool = True,
    bias: torch.Tensor | None = None,
    bias_requires_grad: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    deterministic: bool = False,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    forward_signature: tuple | None = None,
    signature: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of flash attention with respect to q, k, v and, optionally, the bias.

    Takes the forward's inputs (layouts in the module docstring; any strides with stride(-1) == 1),
    its `out` and fp32 `lse`, and the same mask, bias, ALiBi, softcap and dropout arguments as
    `flash_attention_forward`. Returns (dq, dk, dv, dbias): dq/dk/dv with the shapes of q/k/v
    (contiguous unless given below), zero in rows no sequence owns; dbias [b, h_q, s_q, s_k] in
    the bias dtype when `bias_requires_grad`, else None.

    `deterministic=True` (or a requested dBias) runs the two-pass scheme: no atomics, every call
    bitwise reproducible. `deterministic=False` runs the atomic-dQ scheme where `use_atomic_dq`
    allows it (see `ATOMIC_DQ_DEVICES`; off by default): fewer block products, dk/dv still
    bitwise reproducible, dq equal up to fp32 summation order (not bitwise) from run to run.

    On an sm_90 GPU the Hopper kernel may take a non-deterministic call instead
    (`dispatch.sm90_backward_plan`): same outputs, dq up to fp32 summation order.

    `dq`, `dk`, `dv`: optional preallocated outputs with the shapes and dtypes of q/k/v and any
    strides with stride(-1) == 1 (e.g. views of one packed gradient buffer); the kernels write
    into them (zeroing rows no sequence owns) and they are returned in place of new ones.

    `dlse`: the upstream gradient of the LSE (the shape of `lse`, any dtype and strides), or
    None when the loss does not read the LSE. It is folded into delta wherever delta is computed
    (`_common.delta_minus_dlse`: the preprocess, or the dQ pass of short calls), so every scheme
    takes it at the cost of one more load per row; rows with LSE -inf ignore it. Its presence
    changes the launches, so it is part of the launch signature.

    `forward_signature`: the forward's `_common.attention_signature` of these inputs and
    arguments, when the caller kept it (the eager route does); computed here otherwise.

    `signature`: this backward's launch signature, for a caller that can vouch for it more
    cheaply than the tensors can: it must differ wherever any tensor argument's
    `_launch.tensor_signature` or any switch above differs (`dlse` included: absent, or its
    tensor signature). The eager route made out, lse and the given dq/dk/dv itself, so their
    signatures follow from the forward's and its packed-gradient plan, and it keys the backward
    by those, dout's and dlse's (`attention_ops`).
    """
    if dlse is not None:
        if dlse.shape != lse.shape:
            raise ValueError(
                f"dlse of shape {tuple(dlse.shape)} must have the LSE's shape {tuple(lse.shape)}"
            )
        # Laid out like the contiguous LSE (and delta): the kernels read it with their strides.
        # Its signature (below, or the caller's) is that of the tensor given: whether this makes
        # a new fp32 contiguous tensor follows from its dtype, shape and strides.
        dlse = dlse.to(torch.float32).contiguous()
    if signature is None:
        if forward_signature is None:
            forward_signature = attention_signature(**locals())
        # What every launch below specializes on (`_launch.call_signature`), computed once:
        # the forward's inputs and arguments, plus the tensors and switches only the backward
        # has. The plan is keyed by it and by the settings `_make_plan` reads.
        signature = call_signature(
            (dout, out, lse, dq, dk, dv, dlse),
            (forward_signature, bias_requires_grad, deterministic),
        )
    key = (
        signature, ATOMIC_DQ_DEVICES, GROUP_SPLITS_OVERRIDE, DELTA_IN_DQ_MAX_LEN, backward_path(),
        _common.CAUSAL_ORDER_L2_BYTES,
    )  # fmt: skip
    seq_args = (
        cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, max_seqlen_q, max_seqlen_k,
        seqlens_q, seqlens_k,
    )  # fmt: skip
    lse = lse.contiguous()
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(
            dout, q, k, v, out, lse, dq, dk, dv, _geometry(q, k, seq_args),
            softmax_scale=softmax_scale, bottom_right=bottom_right,
            bias_requires_grad=bias_requires_grad, deterministic=deterministic,
            window_left=window_left, window_right=window_right, bias=bias,
            alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
            has_dlse=dlse is not None,
        )  # fmt: skip
        remember(_PLANS, key, plan, MAX_PLANS)
    dk = _new_grad(k, plan.owns_k, dk)
    dv = _new_grad(v, plan.owns_k, dv)
    seq_ptrs = plan.pointers(
        (cu_seqlens_q, cu_seqlens_k, seq_offsets_q, seq_offsets_k, seqlens_q, seqlens_k, q)
    )
    # Without a bias, ALiBi or dQ accumulator the kernels never read that pointer: q stands in.
    bias_ptr = bias if bias is not None else q
    alibi_ptr = alibi_slopes if alibi_slopes is not None else q
    # Without an LSE gradient the kernels never read that pointer either (HAS_DLSE off).
    dlse_ptr = dlse if dlse is not None else q
    tail = (seed, offset)
    if plan.delta_in_dq:
        # Short two-pass calls: the dQ pass computes delta = rowsum(dO * O) and the dK/dV pass,
        # after it, reads it; no preprocess launch.
        delta = torch.empty_like(lse)
        dq, dbias = _launch_dq(plan, q, k, v, dout, out, lse, delta, dlse_ptr, dq, bias,
                               bias_ptr, alibi_ptr, seq_ptrs, tail, signature)  # fmt: skip
        _launch_dkdv(plan, (q, k, v, dout, lse, delta), dk, dv, (bias_ptr, alibi_ptr, q),
                     seq_ptrs, tail, signature)  # fmt: skip
        return dq, dk, dv, dbias
    if not (plan.sm90 or plan.atomic):
        delta = _preprocess(plan.preprocess, out, dout, lse, dlse_ptr, q, seq_ptrs, signature)
        _launch_dkdv(plan, (q, k, v, dout, lse, delta), dk, dv, (bias_ptr, alibi_ptr, q),
                     seq_ptrs, tail, signature)  # fmt: skip
        # delta already holds dlse: this dQ pass does not read it (HAS_DLSE off in its plan).
        dq, dbias = _launch_dq(plan, q, k, v, dout, out, lse, delta, q, dq, bias, bias_ptr,
                               alibi_ptr, seq_ptrs, tail, signature)  # fmt: skip
        return dq, dk, dv, dbias
    # The fp32 dQ accumulator of the schemes that sum dQ with atomics, zeroed by the preprocess
    # where the plan says so. Where it does not, q stands in (the kernel never reads it), so the
    # preprocess's tensor arguments follow from the signature and that switch.
    zero_dq = plan.preprocess.kwargs["ZERO_DQ"]
    sm90 = sm90_kernels("_flash_bwd_sm90")  # loaded on first use (`dispatch`)
    dq_acc = sm90.dq_accumulator(q, zeroed=not zero_dq, width=plan.dq_width)
    delta = _preprocess(
        plan.preprocess, out, dout, lse, dlse_ptr, dq_acc if zero_dq else q, seq_ptrs, signature
    )
    if plan.sm90:
        # One launch for dQ, dK and dV on Hopper (`dispatch`); dQ sums by TMA reduce-adds.
        geom = plan.geometry if plan.geometry is not None else _geometry(q, k, seq_args)
        sm90.backward_sm90(
            q, k, v, dout, lse, delta, dq_acc, dk, dv, geom,
            softmax_scale=softmax_scale, causal=window_right == 0, bottom_right=bottom_right,
            signature=signature,
        )  # fmt: skip
        return _scaled_dq(dq_acc, dq, q, softmax_scale), dk, dv, None
    _launch_dkdv(plan, (q, k, v, dout, lse, delta), dk, dv, (bias_ptr, alibi_ptr, dq_acc),
                 seq_ptrs, tail, signature)  # fmt: skip
    return _scaled_dq(dq_acc, dq, q, softmax_scale), dk, dv, None


def _launch_dq(
    plan, q, k, v, dout, out, lse, delta, dlse, dq, bias, bias_ptr, alibi_ptr, seq_ptrs, tail,
    signature,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The two-pass scheme's dQ pass: (dq, dbias), allocated here unless dq is given. It reads
    delta, or computes and stores it where the plan says so (`BackwardPlan.delta_in_dq`), minus
    `dlse` where its plan has HAS_DLSE (q stands in for dlse otherwise)."""
    dq = _new_grad(q, plan.owns_q, dq)
    dbias = None
    if plan.dbias_shape is not None:
        # Zeros: the dQ pass writes dBias only on the key blocks some query of each block sees.
        dbias = torch.zeros(plan.dbias_shape, dtype=bias.dtype, device=bias.device)
    launch_planned(_flash_bwd_dq_kernel, plan.dq,
        q, k, v, dout, out, lse, delta, dlse, dq, bias_ptr, dbias if dbias is not None else q,
        alibi_ptr, *seq_ptrs, *plan.dq.ints, *tail, signature=signature,
    )  # fmt: skip
    return dq, dbias


def _geometry(q: torch.Tensor, k: torch.Tensor, seq_args: tuple) -> LaunchGeometry:
    """`launch_geometry` of a call from its sequence arguments in signature order
    (cu_seqlens_q/k, seq_offsets_q/k, max_seqlen_q/k, seqlens_q/k)."""
    return launch_geometry(q, k, **dict(zip(_SEQ_ARGS, seq_args)))


_SEQ_ARGS = (
    "cu_seqlens_q", "cu_seqlens_k", "seq_offsets_q", "seq_offsets_k", "max_seqlen_q",
    "max_seqlen_k", "seqlens_q", "seqlens_k",
)  # fmt: skip


def _scaled_dq(
    dq_acc: torch.Tensor, dq: torch.Tensor | None, q: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """The atomic schemes' dQ epilogue: softmax_scale x the fp32 accumulator's first d columns
    (q's head dim; the sm_90 backward's accumulator may be wider, its padding holding
    garbage: `dq_accumulator`), cast to q's dtype on the store, one elementwise pass; into `dq`
    when given, else a new tensor shaped like q (fp32 and as wide: the accumulator itself, in
    place). The caller zero-fills the accumulator: the kernels only add, and rows no program
    reaches (padding, rows past seqlens_q) must come out 0."""
    d = q.shape[-1]
    padded = dq_acc.shape[-1] != d
    if padded:
        dq_acc = dq_acc[..., :d]
    if dq is None:
        if q.dtype == torch.float32 and not padded:
            dq = dq_acc
        else:
            dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.mul(dq_acc, softmax_scale, out=dq)
    return dq


def group_splits(programs: int, group: int, device: torch.device, causal: bool) -> int:
    """How many programs share one key block's GQA group in the dK/dV pass (1 = no split).

    The pass runs one program per (key block, KV head, sequence), each looping over the group's
    query heads; with few KV heads (MQA) that is too few programs to fill the GPU, and under a
    causal mask (`causal`: a right window bound) the first key blocks carry most of the work, so
    the last wave runs nearly empty. Splitting the group multiplies the programs until about
    MIN_DKDV_WAVES waves; the shares' fp32 partial sums are added up afterwards (deterministic,
    no atomics). Every share gets at least one head.
    """
    if GROUP_SPLITS_OVERRIDE is not None:
        wanted = GROUP_SPLITS_OVERRIDE
    elif device.type != "cuda" or group == 1:
        return 1
    else:
        waves = MIN_DKDV_WAVES[0 if causal else 1]
        wanted = cdiv(waves * multiprocessors(device), programs)
    wanted = max(1, min(group, wanted))
    return cdiv(group, cdiv(group, wanted))


def _make_plan(
    dout, q, k, v, out, lse, dq, dk, dv, geo, *, softmax_scale, window_left, window_right,
    bottom_right, bias, bias_requires_grad, alibi_slopes, softcap, dropout_p, deterministic,
    has_dlse,
) -> BackwardPlan:  # fmt: skip
    """The backward's plan for this call's signature: which kernels run, and every grid, stride,
    scalar and constexpr of their launches. Reads shapes, strides, dtypes and devices only;
    buffers the launcher allocates are stood in for by meta tensors with their strides.
    `has_dlse`: the call has an LSE gradient, which the launch that computes delta subtracts."""
    varlen, h_q, h_kv = geo.varlen, q.shape[-2], k.shape[-2]
    max_q, max_k = geo.q.max_len, geo.k.max_len
    sm90_here = sm90_backward_plan(
        q, k, v, dout, lse, geo, window_left=window_left, window_right=window_right, bias=bias,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
        deterministic=deterministic,
    ) is not None  # fmt: skip
    dq, dk, dv = (g if g is not None else _meta(t.shape) for g, t in ((dq, q), (dk, k), (dv, v)))
    dbias_shape = None
    if bias is not None and bias_requires_grad:
        dbias_shape = (geo.batch, h_q, max_q, max_k)
    opts = _bwd_options(q, v, geo, bias, alibi_slopes, window_left, window_right, bottom_right,
                        softcap, dropout_p)  # fmt: skip
    strides = _strides(q, k, v, dout, lse, varlen)
    ints = (h_q, h_kv, max_q, max_k, q.shape[-1], v.shape[-1], softmax_scale,
            softcap if softcap > 0 else 1.0, window_left, window_right, dropout_p)  # fmt: skip
    bias_strides = tuple(bias.stride()) if bias is not None else (0, 0, 0, 0)
    alibi_strides = tuple(alibi_slopes.stride()) if alibi_slopes is not None else (0, 0)
    d_qk, d_v = q.shape[-1], v.shape[-1]
    atomic = use_atomic_dq(q, deterministic, dbias_shape is not None)
    # The schemes that sum dQ into an fp32 accumulator (`dq_accumulator`) have the preprocess
    # zero it where every row belongs to a sequence (its grid visits every owned row; its
    # first d_qk columns, all that is read); else the launcher allocates it zero-filled. The
    # sm_90 kernel's is as wide as its tiles (d = 80, 96: 128 columns a head).
    zero_dq = (sm90_here or atomic) and geo.q.owns_all_rows
    dq_width = sm90_kernels("_flash_bwd_sm90").tile_width(d_qk) if sm90_here else d_qk
    acc_meta = _meta((*q.shape[:-1], dq_width))
    preprocess = PlannedLaunch(
        (cdiv(max_q, PREPROCESS_BLOCK_M) * geo.batch * h_q,),
        (*strides4(out, varlen)[:3], *strides4(dout, varlen)[:3], *lse_strides(lse, varlen),
         *strides4(acc_meta, varlen)[:3], h_q, max_q, d_qk, d_v),
        dict(BLOCK_M=PREPROCESS_BLOCK_M, HEAD_DIM_QK=next_pow2_dim(d_qk),
             HEAD_DIM_V=next_pow2_dim(d_v), PAD_QK=next_pow2_dim(d_qk) != d_qk,
             PAD_V=next_pow2_dim(d_v) != d_v, SEQ_MODE_Q=geo.q.mode, ZERO_DQ=zero_dq,
             HAS_DLSE=has_dlse),
        launch_slot(),
    )  # fmt: skip
    head_dim = max(d_qk, d_v)
    if atomic:
        cfg = bwd_atomic_config(head_dim, q.is_cuda)
    else:
        cfg = bwd_config(
            head_dim, q.is_cuda, max(max_q, max_k), causal=opts["HAS_RIGHT"],
            elem_size=q.element_size(), smem_bytes=smem_per_block(q.device) if q.is_cuda else None,
            bias_elem_size=bias.element_size() if bias is not None else 0,
        )  # fmt: skip
    programs = cdiv(max_k, cfg["BLOCK_N1"]) * geo.batch * h_kv
    splits = group_splits(programs, h_q // h_kv, q.device, causal=opts["HAS_RIGHT"])
    # With splits, the dK/dV pass writes fp32 partial sums [splits, *k.shape] (one share each).
    dk_out, dv_out = (_meta((splits, *t.shape)) if splits > 1 else t for t in (dk, dv))
    dq_acc_strides = strides4(_meta(q.shape), varlen)[:3] if atomic else (0, 0, 0)
    dkdv = PlannedLaunch(
        (programs * splits,),
        (*strides, *_split_strides4(dk_out, splits, varlen)[:3],
         *_split_strides4(dv_out, splits, varlen)[:3], *bias_strides, *alibi_strides,
         *dq_acc_strides, _split_stride(dk_out, splits), _split_stride(dv_out, splits),
         # A (sequence, KV head, share) triple streams its share of the group's q and dO rows.
         causal_order_heads(
             max_q, head_row_bytes(q, dout) * cdiv(h_q // h_kv, splits), 1,
             geo.batch * h_kv * splits,
         ),
         h_q, h_kv, splits, *ints[2:]),
        dict(BLOCK_M=cfg["BLOCK_M1"], BLOCK_N=cfg["BLOCK_N1"], ATOMIC_DQ=atomic, **opts,
             num_warps=cfg["WARPS1"], num_stages=cfg["STAGES1"]),
        launch_slot(),
    )  # fmt: skip
    dq_launch = PlannedLaunch((), (), {}, launch_slot())  # the atomic scheme has no dQ pass
    delta_in_dq = not (atomic or sm90_here) and max(max_q, max_k) <= DELTA_IN_DQ_MAX_LEN
    if not atomic:
        dbias_strides = _meta(dbias_shape).stride() if dbias_shape is not None else (0, 0, 0, 0)
        out_strides = strides4(out, varlen)[:3]
        dq_launch = PlannedLaunch(
            (cdiv(max_q, cfg["BLOCK_M2"]) * geo.batch * h_q,),
            (*strides[:12], *out_strides, *strides[12:], *strides4(dq, varlen)[:3],
             *bias_strides, *dbias_strides, *alibi_strides,
             causal_order_heads(max_k, head_row_bytes(k, v), h_q // h_kv, geo.batch * h_q),
             *ints),
            dict(BLOCK_M=cfg["BLOCK_M2"], BLOCK_N=cfg["BLOCK_N2"],
                 WRITE_DBIAS=dbias_shape is not None, **opts, DELTA_IN_DQ=delta_in_dq,
                 # Only a dQ pass that computes delta folds dlse in; otherwise its delta,
                 # from the preprocess, already holds it.
                 HAS_DLSE=delta_in_dq and has_dlse,
                 num_warps=cfg["WARPS2"], num_stages=cfg["STAGES2"]),
            launch_slot(),
        )  # fmt: skip
    seq_tensors = (geo.q.cu_seqlens, geo.k.cu_seqlens, geo.q.seq_offsets, geo.k.seq_offsets,
                   geo.q.seqlens, geo.k.seqlens)  # fmt: skip
    # Absent tensors still need a pointer argument (index 6, q); the kernels never read it.
    pointers = operator.itemgetter(*(i if t is not None else 6 for i, t in enumerate(seq_tensors)))
    return BackwardPlan(
        sm90=sm90_here, pointers=pointers, geometry=shape_only_geometry(geo),
        owns_q=geo.q.owns_all_rows,
        owns_k=geo.k.owns_all_rows, atomic=atomic, dq_width=dq_width, delta_in_dq=delta_in_dq,
        splits=splits,
        dbias_shape=dbias_shape,
        preprocess=preprocess, dkdv=dkdv, dq=dq_launch,
    )  # fmt: skip


def _meta(shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous stand-in (no storage) for a buffer the launcher allocates: its strides."""
    return torch.empty(shape, device="meta")


def _launch_dkdv(plan, inputs, dk, dv, pointers, seq_ptrs, tail, signature) -> None:
    """The dK/dV kernel; `pointers` = (bias, ALiBi, dQ accumulator), with q standing in for
    absent ones. With a dQ accumulator (the atomic scheme) it also adds the unscaled dQ into it.

    When `group_splits` dealt the GQA group out over several programs (`plan.splits`), they write
    fp32 partial sums `[splits, *k.shape]` that are then added into dk / dv. The launch
    signature adds the split count (a runtime int) to the backward's `signature`.
    """
    splits = plan.splits
    dk_out, dv_out = dk, dv
    if splits > 1:
        # Rows no program writes (past a sequence's end) must add up to 0.
        new = torch.empty if plan.owns_k else torch.zeros
        dk_out = new((splits, *dk.shape), dtype=torch.float32, device=dk.device)
        dv_out = new((splits, *dv.shape), dtype=torch.float32, device=dv.device)
    launch_planned(_flash_bwd_dkdv_kernel, plan.dkdv,
        *inputs, dk_out, dv_out, *pointers, *seq_ptrs, *plan.dkdv.ints, *tail,
        signature=(signature, splits),
    )  # fmt: skip
    if splits > 1:
        # A fixed-order reduction over the shares: bitwise reproducible run to run.
        dk.copy_(dk_out.sum(0))
        dv.copy_(dv_out.sum(0))


def _split_strides4(t: torch.Tensor, splits: int, varlen: bool) -> tuple[int, int, int, int]:
    """strides4 of one share of a [splits, ...] partial buffer, or of t itself."""
    return strides4(t[0] if splits > 1 else t, varlen)


def _split_stride(t: torch.Tensor, splits: int) -> int:
    return t.stride(0) if splits > 1 else 0


def _strides(q, k, v, dout, lse, varlen: bool) -> tuple[int, ...]:
    """(batch, row, head) strides of q, k, v, dout, then (batch, head, row) of the LSE/delta."""
    per_operand = [strides4(t, varlen)[:3] for t in (q, k, v, dout)]
    return (*[s for triple in per_operand for s in triple], *lse_strides(lse, varlen))


def _preprocess(
    launch_plan: PlannedLaunch, out, dout, lse, dlse, dq_acc, seq_ptrs, signature
) -> torch.Tensor:  # fmt: skip
    """delta = rowsum(dout * out) (- dlse where the plan has HAS_DLSE) in fp32, shaped and
    strided like the (contiguous) LSE; zeroes `dq_acc` too where the plan says so (`ZERO_DQ`).
    q stands in for dlse and dq_acc where the plan does not read them."""
    delta = torch.empty_like(lse)
    launch_planned(_flash_bwd_preprocess_kernel, launch_plan,
        out, dout, delta, lse, dlse, dq_acc, seq_ptrs[0], seq_ptrs[2], seq_ptrs[4],
        *launch_plan.ints,
        signature=signature,
    )  # fmt: skip
    return delta


def _bwd_options(q, v, geo, bias, alibi_slopes, window_left, window_right, bottom_right, softcap,
                 dropout_p) -> dict:  # fmt: skip
    """The constexpr switches both gradient kernels share."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    return dict(
        HEAD_DIM_QK=next_pow2_dim(d_qk),
        HEAD_DIM_V=next_pow2_dim(d_v),
        # Mask the head dim only where the tile pads it (see _common.load_tile).
        PAD_QK=next_pow2_dim(d_qk) != d_qk,
        PAD_V=next_pow2_dim(d_v) != d_v,
        SEQ_MODE_Q=geo.q.mode,
        SEQ_MODE_K=geo.k.mode,
        BOTTOM_RIGHT=bool(bottom_right),
        HAS_LEFT=window_left >= 0,
        HAS_RIGHT=window_right >= 0,
        HAS_BIAS=bias is not None,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_SOFTCAP=softcap > 0,
        HAS_DROPOUT=dropout_p > 0,
        # fp32 inputs get full-precision products (no TF32), as PyTorch's fp32 matmul does.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
