"""Launch a `@triton.jit` kernel through its compiled kernel once the specialization is known.

`kernel[grid](*args)` goes through `JITFunction.run` on every call: it re-reads Triton's settings,
binds and specializes every argument, builds a cache key string, checks globals and evaluates
the grid, 40-75 us of host time per launch on the H100's host for kernels of ~50 arguments
(docs/performance.md, "Host time"). Short attention calls are bound by that time, not by the GPU.

`launch(kernel, grid, *args, **kwargs)` does the same launch. The first call for a given
specialization goes through `kernel[grid]` and keeps the compiled kernel it returns; later calls
with the same specialization call the compiled kernel's launcher directly
(`CompiledKernel.run`, the entry `CompiledKernel[grid]` uses too).

The key is at least as fine as Triton's specialization, so one key never maps to two compiled
kernels: constexpr values as given, launch options (num_warps, ...), and per runtime argument
what Triton specializes on: a tensor's dtype and 16-byte alignment, an int's being 1, being a
multiple of 16 and fitting 32 bits (only the last for an int the kernel marks
`do_not_specialize`), None, a bool's value, a `tl.constexpr`'s value, and for a host-side TMA
descriptor what Triton types it by (class, element type, block shape, layout; the launcher
builds its tensor map on every call), so the Gluon kernels launch directly too. Anything else
(a profiler's launch hook, the CPU interpreter, a Triton whose compiled kernel lacks the
launcher) takes `kernel[grid]` every time, which is always correct.

Computing that key costs ~1 us per argument in Python, a third of a short attention forward's
host time. A caller that already knows what determines the specialization passes it as
`signature=` (from `call_signature`: every input tensor's shape, strides, dtype, device and
16-byte alignment, and the scalar arguments): the compiled kernel is then looked up by the
signature and the launch's keywords, and the per-argument key is computed only the first time a
signature is seen. The contract: with the same signature and keywords, every runtime argument
specializes the same way. `set_signature_checks(True)` verifies it on every launch (the GPU
suite runs with it on).

A launch plan that repeats one launch with the same keywords, grid and specialization (the
attention kernels' plans, one per signature) passes `slot=`, a dict it owns (`launch_slot()`).
After the first direct launch the slot holds, per device, the call it makes with the evaluated
grid and the keyword values in parameter order, so later launches skip even the signature
lookup: a few microseconds less Python per launch, which autograd's device thread pays twice
over (docs/performance.md, "Host time on autograd's device thread"). Where Triton's Python
around the compiled kernel's C launcher would only pass the arguments on (Triton 3.6: no
scratch buffers; TMA descriptors encoded into tensor maps), that call is the C launcher itself,
with each descriptor's tensor map kept by address (`_bound_call`). With signature checks on, a
slotted launch takes the keyed path, checks that the slot holds what it finds, then launches
through the slot. A bound slot needs only the positional arguments: `launch_bound` launches
through it without the keywords, which cost Python to gather, and `launch_planned` does so for a
`PlannedLaunch`, calling `launch` only until its slot is bound.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _compat

try:
    from triton import knobs
except ImportError:  # Triton < 3.4: another launcher convention; its own path only
    knobs = None

_MIN_INT32, _MAX_INT32 = -(2**31), 2**31 - 1
# Off outside the Triton releases it was tested on (`_compat.FAST_PATHS_OFF`).
_enabled = knobs is not None and _compat.FAST_PATHS_OFF is None
_check_signatures = False


class _Unsupported(Exception):
    """An argument this module cannot key: the call takes Triton's own path."""


def set_direct_launch(enabled: bool) -> bool:
    """Turn the direct path on or off (for comparisons); returns the previous setting."""
    global _enabled
    previous = _enabled
    _enabled = bool(enabled) and knobs is not None and _compat.FAST_PATHS_OFF is None
    return previous


def set_signature_checks(enabled: bool) -> bool:
    """Verify every `signature=` launch against the per-argument key (for tests); returns the
    previous setting. A signature that maps to a kernel compiled for another specialization
    raises `AssertionError`."""
    global _check_signatures
    previous, _check_signatures = _check_signatures, bool(enabled)
    return previous


def tensor_signature(t: torch.Tensor | None) -> tuple | None:
    """What a launch's specialization can depend on in a tensor: shape, strides, dtype, device
    and 16-byte alignment (not its values)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def call_signature(tensors: tuple, scalars: tuple) -> tuple:
    """The `signature=` of launches made from these input tensors (None allowed) and scalars
    (hashable; ints that reach a kernel as runtime arguments must be given as their values or
    as `int_signature`). Outputs the launcher allocates need not be listed: their shapes follow
    from the inputs and the allocator aligns them."""
    return (*map(tensor_signature, tensors), *scalars)


def int_signature(value: int) -> tuple:
    """How Triton specializes a runtime int, for signatures of ints that change every call
    (dropout seeds and offsets)."""
    return _runtime_key(value)


def _runtime_key(value, specialized: bool = True):
    cls = value.__class__
    if cls is int and not specialized:  # `do_not_specialize`: only its width is in the type
        return _MIN_INT32 <= value <= _MAX_INT32
    if cls is int:
        return (value == 1, value % 16 == 0, _MIN_INT32 <= value <= _MAX_INT32)
    if cls is float:
        return float
    if value is None or cls is bool:
        return value
    if cls is tl.constexpr:
        # A constexpr in a runtime parameter's place (a host expression such as
        # `scale * LOG2E` with `LOG2E` a `tl.constexpr` yields one): Triton compiles its value
        # into the kernel and the launcher skips it, so its value is the key.
        return (tl.constexpr, value.value)
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    base = getattr(value, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(value, "block_shape"):
        # A host-side TMA descriptor (Triton's or Gluon's `TensorDescriptor`): Triton types it
        # by its class, element type, block shape and (Gluon) shared-memory layout; the
        # launcher builds the CUDA tensor map from its base, shape and strides on every call.
        return (
            cls, base.dtype, tuple(value.block_shape), repr(getattr(value, "layout", None)),
            getattr(value, "padding", None),
        )  # fmt: skip
    raise _Unsupported(cls.__name__)


class _KernelLaunches:
    """One kernel's parameter layout and its compiled kernels by specialization key."""

    def __init__(self, kernel: triton.JITFunction) -> None:
        params = kernel.params
        self.names = [p.name for p in params]
        self.known = set(self.names)
        self.constexpr = [p.is_constexpr for p in params]
        self.specialized = [not getattr(p, "do_not_specialize", False) for p in params]
        self.defaults = {p.name: p.default for p in params if p.has_default}
        self.compiled: dict[tuple, object] = {}
        self.by_signature: dict[tuple, object] = {}
        self.broken = False  # the direct launcher failed once: Triton's path from then on

    def values(self, args: tuple, kwargs: dict) -> list:
        """Every parameter's value in signature order (what `CompiledKernel.run` takes)."""
        values = list(args)
        for name in self.names[len(args) :]:
            values.append(kwargs[name] if name in kwargs else self.defaults[name])
        return values

    def key(self, values: list, kwargs: dict, device: int) -> tuple:
        spec = tuple(
            value if is_constexpr else _runtime_key(value, specialized)
            for value, is_constexpr, specialized in zip(values, self.constexpr, self.specialized)
        )
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.known))
        return device, spec, options


_LAUNCHES: dict[int, _KernelLaunches] = {}


# A signature table larger than this is dropped and rebuilt (a long run of new shapes).
_MAX_SIGNATURES = 4096


def launch_slot() -> dict:
    """A new, empty `slot=` for one launch of a plan (module docstring)."""
    return {}


class PlannedLaunch(NamedTuple):
    """One launch a plan repeats: its grid, the host-side ints and floats that follow its tensor
    arguments (up to any per-call ones), its keywords and its `launch_slot` (the compiled
    kernel, bound on first use)."""

    grid: tuple[int, ...]
    ints: tuple
    kwargs: dict
    slot: dict


def config_slot(slot: dict, config) -> dict:
    """The part of an autotuned launch's slot that belongs to one of the autotuner's picks
    (`triton.Config`): a plan keeps one tuning key, but a test or tool may clear the picks and
    tune again, and a slot must only ever see one kernel. Keyed by identity; the config is kept
    beside its part, so a reused id cannot alias another config."""
    entry = slot.get(id(config))
    if entry is None or entry[0] is not config:
        entry = slot[id(config)] = (config, launch_slot())
    return entry[1]


def launch_bound(slot: dict | None, args: tuple) -> bool:
    """Launch `args` through the kernel `slot` holds bound for the current device; True where it
    did, False where the slot holds none yet or the full path must run (signature checks on, a
    profiler's launch hook, the direct path off). A caller whose keywords cost Python to gather
    (a dozen constexprs, an autotuner pick's `all_kwargs()`: 1.6 us on a 2-core CPU for the
    decode kernel's) tries this first and calls `launch` only where it returns False."""
    if slot and _enabled and not _check_signatures:
        device = _current_device()
        bound = slot.get(device)
        if bound is not None and not _hooked():
            bound[0](_current_stream(device), args)
            return True
    return False


def launch_planned(kernel, run: PlannedLaunch, *args, signature: tuple | None = None) -> None:
    """`launch` of a plan's repeated launch `run` with these positional arguments: through its
    slot alone once bound, so its keywords are gathered only until then."""
    if not launch_bound(run.slot, args):
        launch(kernel, run.grid, *args, **run.kwargs, signature=signature, slot=run.slot)


def launch(
    kernel, grid, *args, signature: tuple | None = None, slot: dict | None = None, **kwargs
) -> None:
    """`kernel[grid](*args, **kwargs)`, through the compiled kernel's launcher after the first.

    `kernel` is a `triton.JITFunction` (for an autotuned kernel, its `.fn` with a config's
    kwargs); `grid` a tuple, or a callable of the launch's keyword arguments. `signature`, when
    given, identifies the specialization in place of the per-argument key; `slot`, when given,
    binds the compiled kernel to the caller's plan (module docstring). A slot must only ever see
    one kernel, one grid, the same keywords, the same number of positional arguments and TMA
    descriptors of one geometry (only their tensors change).
    """
    if launch_bound(slot, args):
        return
    if not _enabled or not isinstance(kernel, triton.JITFunction) or _hooked():
        kernel[grid](*args, **kwargs)
        return
    launches = _LAUNCHES.get(id(kernel))
    if launches is None:
        launches = _LAUNCHES[id(kernel)] = _KernelLaunches(kernel)
    if launches.broken:
        kernel[grid](*args, **kwargs)
        return
    device = _current_device()
    values = launches.values(args, kwargs)
    compiled = None
    if signature is not None:
        fast_key = (device, signature, tuple(kwargs.items()))
        compiled = launches.by_signature.get(fast_key)
        if compiled is not None and _check_signatures:
            key = launches.key(values, kwargs, device)
            assert launches.compiled.get(key) is compiled, (
                f"launch signature of {kernel.fn.__name__} maps to a kernel compiled for another "
                "specialization"
            )
    if compiled is None:
        try:
            key = launches.key(values, kwargs, device)
        except _Unsupported:
            kernel[grid](*args, **kwargs)
            return
        compiled = launches.compiled.get(key)
        if compiled is not None and signature is not None:
            if len(launches.by_signature) >= _MAX_SIGNATURES:
                launches.by_signature.clear()
            launches.by_signature[fast_key] = compiled
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # an asynchronous compile hands back a future
            compiled = compiled.result()
        if hasattr(compiled, "packed_metadata"):  # not under the CPU interpreter
            launches.compiled[key] = compiled
        return
    if callable(grid):
        grid = grid(kwargs)
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    stream = _current_stream(device)
    tail = tuple(values[len(args) :])
    bound = slot.get(device) if slot is not None else None
    if bound is not None:
        # Signature checks on (the fast path above takes bound slots otherwise): the slot must
        # hold what the key found; then it launches, as it does for users.
        assert bound[3] is compiled and bound[1] == grid3 and bound[2] == tail, (
            f"launch slot of {kernel.fn.__name__} holds another kernel, grid or keywords"
        )
        bound[0](stream, args)
        return
    try:
        run = compiled.run  # loads the module on first use
        run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None,
            *values)  # fmt: skip
    except TypeError:
        # A Triton whose launcher takes other arguments: the C launcher checks its argument
        # list before launching, so nothing ran. Take Triton's path for good.
        launches.broken = True
        kernel[grid](*args, **kwargs)
        return
    if slot is not None:
        call = _bound_call(run, compiled.function, compiled.packed_metadata, grid3, tail, len(args))
        slot[device] = (call, grid3, tail, compiled)


# Triton 3.6's C launcher parses its leading arguments with this format (grid x/y/z, stream,
# function, cooperative grid, PDL, global and profile scratch, metadata, launch metadata and the
# two hooks); `_bound_call` calls it directly only where the driver declares exactly this.
_C_LAUNCH_FORMAT = "iiiKKppOOOOOO"
# Per TMA descriptor argument of a slot: tensor maps kept by base address.
_MAX_TENSOR_MAPS = 64


def _nvidia_driver():
    """Triton's NVIDIA driver module, or None where it does not import."""
    try:
        from triton.backends.nvidia import driver
    except ImportError:
        return None
    return driver


def _bound_call(run, function, metadata, grid3, tail: tuple, n_args: int):
    """What a bound slot calls per launch, `call(stream, args)`: the compiled kernel's C
    launcher itself where Triton's Python around it would only pass its arguments through,
    else `run` (the launcher object `CompiledKernel.run` returns) as before.

    Around the C launcher Triton 3.6 runs, per launch, Python that allocates scratch buffers
    (none for kernels that declare no scratch) and, for kernels with host-side TMA descriptors,
    a loop over every argument that encodes each descriptor's CUDA tensor map afresh: about
    19 us of the H100 host's time for the sm_90 forward's four descriptors, against 8 us for
    the C launcher alone. A slot's descriptors keep one geometry (its plan fixes their shapes,
    strides, blocks and layouts; only their tensors change), so a tensor map depends only on
    the tensor's address: the call keeps the maps it encoded, by address, per descriptor
    argument (a training loop's allocator hands the same addresses back step after step), and
    encodes them with Triton's own `make_tensordesc_arg`. With signature checks on, a kept map
    is checked against a fresh encoding's shape and strides.

    Taken only where the driver's argument format is `_C_LAUNCH_FORMAT`, the launcher declares
    no scratch, and every descriptor is lowered to a tensor map; any other Triton keeps `run`.
    """
    direct = _c_launcher(run, n_args)
    if direct is None:

        def call(stream, args):
            run(*grid3, stream, function, metadata, None, None, None, *args, *tail)

        return call
    c_launch, descriptors, encode = direct
    flags = (run.launch_cooperative_grid, run.launch_pdl, None, None, metadata, None, None, None)
    if not descriptors:

        def call(stream, args):
            c_launch(*grid3, stream, function, *flags, *args, *tail)

        return call
    # Last first, so splicing a descriptor's expansion in leaves earlier positions in place.
    maps = [(position, meta, {}) for position, meta in reversed(descriptors)]

    def call(stream, args):
        values = list(args)
        for position, meta, kept in maps:
            desc = values[position]
            address = desc.base.data_ptr()
            expanded = kept.get(address)
            if expanded is None:
                if len(kept) >= _MAX_TENSOR_MAPS:
                    kept.clear()
                expanded = kept[address] = encode(desc, meta)
            elif _check_signatures:
                fresh = encode(desc, meta)
                assert fresh[1:] == expanded[1:], "a slot's TMA descriptor changed its geometry"
            values[position : position + 1] = expanded
        c_launch(*grid3, stream, function, *flags, *values, *tail)

    return call


def _c_launcher(run, n_args: int):
    """(C launch function, [(argument position, descriptor metadata)], tensor-map encoder)
    for Triton 3.6's CUDA launcher object, else None (`_bound_call`)."""
    driver = _nvidia_driver()
    if driver is None or getattr(driver, "_BASE_ARGS_FORMAT", None) != _C_LAUNCH_FORMAT:
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    if not all(hasattr(run, name) for name in ("launch_cooperative_grid", "launch_pdl")):
        return None
    c_launch = getattr(run, "launch", None)
    code = getattr(c_launch, "__code__", None)
    if code is None:  # no descriptors: `launch` is the C function itself
        return (c_launch, (), None) if callable(c_launch) else None
    # With descriptors: `wrap_handle_tensordesc`'s closure over the C function.
    if set(code.co_freevars) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in c_launch.__closure__)))
    positions, metas = sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]
    encode = getattr(driver, "make_tensordesc_arg", None)
    if encode is None or not metas or len(metas) != len(positions):
        return None
    # A descriptor not lowered to a tensor map expands to its tensor, which a kept expansion
    # would hold on to; and every descriptor must be one of the call's own arguments.
    if any(meta is None for meta in metas) or any(p >= n_args for p in positions):
        return None
    return cells["launcher"], list(zip(positions, metas)), encode


def _current_device() -> int:
    return triton.runtime.driver.active.get_current_device()


def _current_stream(device: int):
    return triton.runtime.driver.active.get_current_stream(device)


def _hooked() -> bool:
    """A profiler's launch hook is installed: let Triton call it."""
    return _installed(knobs.runtime.launch_enter_hook) or _installed(knobs.runtime.launch_exit_hook)


def _installed(hook) -> bool:
    # Triton 3.6 keeps None when no hook is set; later versions keep an always-present chain
    # (`HookChain`) whose `calls` list is empty.
    return hook is not None and bool(getattr(hook, "calls", True))
