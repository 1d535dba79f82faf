"""What the sm_90 Gluon kernels (`_flash_fwd_sm90`, `_flash_bwd_sm90`) share: the Gluon imports
for Hopper, the device helpers both kernels call, and the host side of their TMA reads.

Every operand is read through one 2-D TMA descriptor over its storage, rows of `stride_s`
elements (`tma_view`): head h of sequence z starts at element `z * stride_b + h * stride_h`,
i.e. at grid row `(that) // stride_s`, column `(that) % stride_s` (`_tile_origin`), so bshd,
sbhd, thd and the packed QKV views take the same path without a copy.
"""

from __future__ import annotations

import functools

import torch

from . import _compat
from ._common import next_pow2
from ._launch import int_signature, launch_slot


def tile_width(d: int) -> int:
    """The width of head dim d's tiles in both sm_90 kernels (their TMA boxes, and the key of
    their tables): the next power of two, so that dims between widths (80, 96; 160, 192) run on
    the next width up, taking their own columns only (`_product_over_dim`)."""
    return next_pow2(d)


try:  # Gluon ships with Triton 3.5+; its Hopper module is what this path needs.
    if _compat.FAST_PATHS_OFF:  # an untested Triton: the portable kernels take every call
        raise ImportError(_compat.FAST_PATHS_OFF)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # The CTA-wide barrier is `gl.thread_barrier` in Triton 3.6 and `gl.barrier` from 3.7 on;
    # inside a warp-specialized partition both sync only that partition's warps.
    _partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # The TMA load is `tma.async_copy_global_to_shared` in 3.6, `tma.async_load` later.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # And the TMA store: `tma.async_copy_shared_to_global` in 3.6, `tma.async_store` later.
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    GLUON_AVAILABLE = True
except Exception:  # noqa: BLE001 - any import failure means: no Gluon path on this install
    GLUON_AVAILABLE = False


if GLUON_AVAILABLE:

    @gluon.jit
    def _product_over_dim(a_tile, b_tile, zero, D: gl.constexpr):
        """a b^T over the first D columns of two tiles of one width, as asynchronous wgmma: the
        forward's S = Q K^T, the backward's key-major S^T = K Q^T and dP^T = V dO^T. One group
        when D is the width, else two: the first half of the width, then the rest, a power of
        two of at least 16 (wgmma's K step for 16-bit types): 80 = 64 + 16, 96 = 64 + 32 on
        128-wide tiles, 160 = 128 + 32, 192 = 128 + 64 on 256-wide ones. The tiles' columns past
        D (the next head's data, or TMA's zero fill; NaN possibly) never enter the product."""
        WIDTH: gl.constexpr = a_tile.type.shape[1]
        if D == WIDTH:
            tok = warpgroup_mma(a_tile, b_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
        else:
            LO: gl.constexpr = WIDTH // 2
            HI: gl.constexpr = D - LO
            gl.static_assert(HI >= 16 and (HI & (HI - 1)) == 0)
            tok = warpgroup_mma(
                a_tile.slice(0, LO, dim=1), b_tile.slice(0, LO, dim=1).permute((1, 0)), zero,
                use_acc=False, is_async=True,
            )  # fmt: skip
            tok = warpgroup_mma(
                a_tile.slice(LO, HI, dim=1), b_tile.slice(LO, HI, dim=1).permute((1, 0)), tok,
                is_async=True,
            )  # fmt: skip
        return tok

    @gluon.jit
    def _seq_bounds(z, cu_ptr, offsets_ptr, seqlens_ptr, full_len, SEQ_MODE: gl.constexpr):
        """(first row in memory, length) of sequence z: the modes of `_common.seq_bounds`."""
        if SEQ_MODE == 0:
            start = z * 0
            length = full_len + z * 0
        elif SEQ_MODE == 1:
            start = z * 0
            length = gl.load(seqlens_ptr + z)
        else:
            cu_lo = gl.load(cu_ptr + z)
            length = gl.load(cu_ptr + z + 1) - cu_lo
            if SEQ_MODE == 3:
                start = gl.load(offsets_ptr + z)
            else:
                start = cu_lo
        return start, length

    @gluon.jit
    def _interleaved_tile(pid, num_blocks, num_pairs, order_pairs):
        """`_common.interleaved_tile` in Gluon (a Gluon kernel calls only Gluon functions)."""
        per_group = num_blocks * order_pairs
        first = (pid // per_group) * order_pairs
        pairs = gl.minimum(order_pairs, num_pairs - first)  # the last group may be smaller
        r = pid % per_group
        return first + r % pairs, r // pairs

    @gluon.jit
    def _tile_origin(z, h, start, stride_b, stride_h, stride_s):
        """TMA (row, column) of row `start` of head h of sequence z, in the `tma_view` grid."""
        base = z.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h
        row = (base // stride_s).to(gl.int32) + start
        col = (base % stride_s).to(gl.int32)
        return row, col

    @gluon.jit
    def _release(bar):
        """Hand a stage back to the producer once every warp of this warpgroup is done with it
        (the arrive is one thread's; the barrier orders the other warps' reads before it)."""
        _partition_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _zero_rows_from(tile, valid, CHUNK: gl.constexpr):
        """Zero rows valid.. of a [rows, d] tile in shared memory (no-op when all are valid),
        CHUNK rows at a time.

        Rows past a sequence's end hold whatever follows it (padding may be NaN), and 0 x NaN
        in a product is NaN, so the forward's last V tile and the backward's K, V, Q and dO
        tiles are zeroed there before their products (the forward masks the scores; the
        backward masks P^T and dS^T). The forward passes the whole tile (CHUNK = rows); the
        backward 16 rows at d = 128 (8 registers a thread beside the dK and dV accumulators)
        and the whole [128, 64] tile at d = 64 (eight unrolled 16-row chunks, each keeping its
        thread-index arithmetic live, made ptxas spill). Every warpgroup that reads the tile
        writes the same zeros, so none sees a partial state.
        """
        rows: gl.constexpr = tile.type.shape[0]
        cols: gl.constexpr = tile.type.shape[1]
        if valid < rows:
            layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            for c in gl.static_range(rows // CHUNK):
                if (c + 1) * CHUNK > valid:
                    part = tile.slice(c * CHUNK, CHUNK)
                    values = part.load(layout)
                    r = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
                    keep = gl.expand_dims(r < valid, 1) & gl.expand_dims(
                        gl.arange(0, cols, layout=gl.SliceLayout(0, layout)) < cols, 0
                    )
                    part.store(gl.where(keep, values, gl.zeros_like(values)))
            # Generic-proxy stores, then async-proxy (wgmma) reads: fence, and wait for all
            # four warps before a product is issued.
            fence_async_shared()
            _partition_barrier()


def tma_view(
    t: torch.Tensor, varlen: bool, block_rows: int, storage_rows: int | None = None
) -> tuple[list, list] | None:
    """(shape, strides) of the 2-D TMA grid over t's storage, or None when TMA cannot read t.

    The grid's rows are `stride_s` elements wide (t's sequence stride); head h of sequence z
    starts at element z * stride_b + h * stride_h of t. TMA needs a 16-byte aligned base and row
    pitch, and each head's d contiguous elements must sit inside one grid row (no wrap): true
    for bshd-like storage (stride_b a multiple of stride_s, heads within a row) and sbhd-like
    storage (every batch entry and head within one row), packed views of either included.

    A grid shorter than one box of `block_rows` rows is None: TMA zero-fills only past the
    grid's end, so a grid stretched to one box would read (or write) the memory behind t, and
    reads past an allocation fault when that memory is unmapped. `storage_rows`: the rows the
    caller knows are allocated behind t's start (`dq_accumulator` pads to one box), or, for a
    tensor TMA only ever writes rows of t into, `block_rows` (the forward's output).
    """
    elem = t.element_size()
    heads, d = t.shape[-2], t.shape[-1]
    if varlen:
        stride_b, stride_s, stride_h, n_batch, n_seq = 0, t.stride(0), t.stride(1), 1, t.shape[0]
    else:
        stride_b, stride_s, stride_h = t.stride(0), t.stride(1), t.stride(2)
        n_batch, n_seq = t.shape[0], t.shape[1]
    if t.stride(-1) != 1 or stride_s <= 0 or stride_h < 0 or stride_b < 0:
        return None
    if t.data_ptr() % 16 or (stride_s * elem) % 16:
        return None
    heads_span = (heads - 1) * stride_h + d
    if n_batch == 1 or stride_b % stride_s == 0:
        fits = heads_span <= stride_s
    else:
        fits = (n_batch - 1) * stride_b + heads_span <= stride_s
    if not fits:
        return None
    last_origin = (n_batch - 1) * stride_b + (heads - 1) * stride_h
    rows = last_origin // stride_s + n_seq
    if rows < block_rows:
        if storage_rows is None or storage_rows < block_rows:
            return None
        rows = block_rows
    return [rows, stride_s], [stride_s, 1]


_GL_DTYPES = {}
if GLUON_AVAILABLE:
    _GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


@functools.cache
def _smem_layout(rows: int, cols: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a [rows, cols] tile (cached: building it costs
    ~20 us of host time, three times a call)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], _GL_DTYPES[dtype])


def descriptor_maker(t: torch.Tensor, view: tuple[list, list], block: list[int], layout=None):
    """A function that makes the TMA descriptor of (`view`, `block`, `layout`: t's swizzled
    tile layout by default) over any tensor with t's launch signature (shape, strides, dtype,
    device, 16-byte alignment), for a launch plan to keep.

    `TensorDescriptor`'s checks read only what that signature fixes, so they run once, on t;
    each call then copies the checked fields and puts its own tensor in (0.3 us against 1.5 for
    the constructor on a 2-core CPU; four to five descriptors per sm_90 launch). The maker keeps
    no reference to t."""
    shape, strides = view
    layout = layout if layout is not None else _smem_layout(*block, t.dtype)
    checked = vars(TensorDescriptor(t, shape, strides, block, layout))
    fields = {name: value for name, value in checked.items() if name != "base"}

    def make(tensor: torch.Tensor):
        desc = object.__new__(TensorDescriptor)
        desc.__dict__.update(fields)
        desc.base = tensor
        return desc

    return make


def launch_binding(signature, order_pairs: int) -> tuple:
    """(signature, slot) that a planned launch hands to `_launch.launch`: the call's signature
    with the launch order's interleave (a module setting, not the inputs) and a slot of its own;
    (None, None) without a signature."""
    if signature is None:
        return None, None
    return (signature, int_signature(order_pairs)), launch_slot()


# The Gluon names the kernels import from here (one place that knows Triton's version
# differences), besides this module's own helpers.
# The host side always exists; the Gluon names and device helpers only where Gluon imports.
__all__ = [
    "GLUON_AVAILABLE", "tma_view", "launch_binding", "_smem_layout",
    "descriptor_maker", "tile_width",
]  # fmt: skip
if GLUON_AVAILABLE:
    __all__ += [
        "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier", "tma",
        "warpgroup_mma", "warpgroup_mma_wait", "_partition_barrier", "_tma_load", "_tma_store",
        "_seq_bounds", "_interleaved_tile", "_tile_origin", "_release", "_zero_rows_from",
        "_product_over_dim",
    ]  # fmt: skip
