"""The direct launcher (kernels/_launch.py): one compiled kernel per specialization, the compiled
kernel's own launcher afterwards, and Triton's path whenever the key cannot be trusted.

Triton's JIT needs a GPU to compile, so `run` is replaced by one that records the launch and hands
back a stand-in compiled kernel that records its direct launches."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from fusedlayers.kernels import _compat, _launch


def _toy(x_ptr, n, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 2):
    pass


class Compiled:
    packed_metadata = "meta"
    function = "fn"

    def __init__(self, log, key):
        self.log, self.key = log, key

    def run(self, *args):
        self.log.append(("direct", self.key, args))


class ToyKernel(triton.runtime.jit.JITFunction):
    """A real JITFunction (parameters and all) whose `run` records instead of compiling."""

    def __init__(self, **options):
        super().__init__(_toy, **options)
        self.log, self.compiles = [], 0

    def run(self, *args, grid, warmup, **kwargs):
        self.compiles += 1
        self.log.append(("triton", grid, args, kwargs))
        return Compiled(self.log, self.compiles)


@pytest.fixture
def kernel(monkeypatch):
    # The mechanism under test, whatever the installed Triton (`_compat`'s window turns the
    # direct path off outside the releases it was tested on; test_compat.py covers that).
    monkeypatch.setattr(_compat, "FAST_PATHS_OFF", None)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 1234)
    monkeypatch.setattr(_launch, "_LAUNCHES", {})
    previous = _launch.set_direct_launch(True)
    yield ToyKernel()
    _launch.set_direct_launch(previous)


def _x(offset=0):
    return torch.zeros(64)[offset:]


def test_second_launch_of_a_specialization_goes_direct(kernel):
    x = _x()
    _launch.launch(kernel, (3,), x, 32, 0.5, True, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["triton"]
    y = _x()
    _launch.launch(kernel, lambda meta: (meta["BLOCK"] * 2, 5), y, 48, 0.25, True, BLOCK=16)
    kind, compiled_key, args = kernel.log[-1]
    assert (kind, compiled_key) == ("direct", 1)
    # grid (from the launch's keywords), stream, function, metadata, no hooks, then every
    # parameter in signature order: the new values, constexprs given and defaulted
    assert args == (32, 5, 1, 1234, "fn", "meta", None, None, None, y, 48, 0.25, True, 16, 2)
    assert kernel.compiles == 1


@pytest.mark.parametrize(
    "change",
    [
        {"n": 33},  # no longer a multiple of 16
        {"n": 1},  # Triton specializes 1
        {"n": 2**40},  # 64-bit
        {"x": _x(offset=1)},  # 4-byte aligned, not 16
        {"x": torch.zeros(64, dtype=torch.float16)},  # another dtype
        {"flag": False},
        {"BLOCK": 32},  # another constexpr
        {"MODE": 3},  # a defaulted constexpr given
        {"num_warps": 8},  # a launch option
    ],
    ids=lambda change: next(iter(change)) + "=" + str(next(iter(change.values())))[:12],
)
def test_any_change_triton_specializes_on_compiles_again(kernel, change):
    base = {"x": _x(), "n": 32, "scale": 0.5, "flag": True, "BLOCK": 16, "num_warps": 4}
    for call in (base, {**base, **change}):
        positional = [call["x"], call["n"], call["scale"], call["flag"]]
        rest = {k: v for k, v in call.items() if k not in ("x", "n", "scale", "flag")}
        _launch.launch(kernel, (1,), *positional, **rest)
    assert kernel.compiles == 2, "a launch reused a kernel compiled for another specialization"
    assert [entry[0] for entry in kernel.log] == ["triton", "triton"]


def test_values_triton_does_not_specialize_on_share_a_kernel(kernel):
    for n, scale in ((32, 0.5), (64, 2.0), (16 * 7, -1.0)):
        _launch.launch(kernel, (1,), _x(), n, scale, True, BLOCK=16)
    assert kernel.compiles == 1
    assert [entry[2][10] for entry in kernel.log[1:]] == [64, 112]  # the new n reaches the kernel


def test_an_int_marked_do_not_specialize_shares_a_kernel_until_it_needs_64_bits(kernel):
    """Triton compiles one kernel for every value of a `do_not_specialize` int (the launch
    order's `order_pairs`), except that its type widens past 32 bits."""
    plain = ToyKernel(do_not_specialize=["n"])
    for n in (1, 7, 32, 2**40):
        _launch.launch(plain, (1,), _x(), n, 0.5, True, BLOCK=16)
    assert plain.compiles == 2
    assert [entry[0] for entry in plain.log] == ["triton", "direct", "direct", "triton"]
    assert plain.log[2][2][10] == 32  # the value reaches the kernel


def test_unkeyable_argument_always_takes_tritons_path(kernel):
    for _ in range(2):
        _launch.launch(kernel, (1,), object(), 32, 0.5, True, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton"]


def test_a_launcher_of_another_convention_falls_back_for_good(kernel, monkeypatch):
    _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16)

    def other_convention(self, grid_x, grid_y, grid_z, stream, function, *args):
        raise TypeError("function takes exactly 40 arguments")

    monkeypatch.setattr(Compiled, "run", other_convention)
    for _ in range(2):
        _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton", "triton"]


def test_profiler_hooks_and_the_switch_take_tritons_path(kernel, monkeypatch):
    runtime = _launch.knobs.runtime
    no_hook = runtime.launch_enter_hook  # None (Triton 3.6) or an empty chain (later)
    _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16)
    monkeypatch.setattr(runtime, "launch_enter_hook", lambda *args: None)
    _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16)
    monkeypatch.setattr(runtime, "launch_enter_hook", no_hook)
    _launch.set_direct_launch(False)
    _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16)
    _launch.set_direct_launch(True)
    _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton", "triton", "direct"]


# --- `signature=`: the caller names the specialization, the per-argument key is skipped -------


def _count_keys(monkeypatch):
    monkeypatch.setattr(_launch, "_check_signatures", False)  # conftest turns them on
    calls = []
    real = _launch._KernelLaunches.key

    def counting(self, *args):
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(_launch._KernelLaunches, "key", counting)
    return calls


def test_a_known_signature_launches_without_the_per_argument_key(kernel, monkeypatch):
    keys = _count_keys(monkeypatch)
    for n in (32, 32, 48, 48):
        x = _x()
        signature = _launch.call_signature((x,), (n,))
        _launch.launch(kernel, (1,), x, n, 0.5, True, BLOCK=16, signature=signature)
    # compile (key), first direct launch of the signature (key), then the table; n=48: new
    # signature (key), then the table
    assert len(keys) == 3
    assert kernel.compiles == 1
    assert [entry[0] for entry in kernel.log] == ["triton", "direct", "direct", "direct"]
    assert [entry[2][10] for entry in kernel.log[1:]] == [32, 48, 48]


def test_a_signature_is_per_launch_keywords(kernel):
    x = _x()
    signature = _launch.call_signature((x,), (32,))
    for block in (16, 16, 32, 32):
        _launch.launch(kernel, (1,), x, 32, 0.5, True, BLOCK=block, signature=signature)
    assert kernel.compiles == 2
    assert [entry[1] for entry in kernel.log if entry[0] == "direct"] == [1, 2]


def test_tensor_signature_tells_apart_what_triton_specializes_on():
    base = torch.zeros(4, 8)
    signatures = {
        _launch.tensor_signature(t)
        for t in (
            base,
            torch.zeros(4, 8),  # same signature as base
            base.t(),  # strides
            torch.zeros(4, 9),  # shape
            torch.zeros(4, 8, dtype=torch.float16),  # dtype
            torch.zeros(40)[1:33].view(4, 8),  # 4-byte aligned
        )
    }
    assert len(signatures) == 5
    assert _launch.tensor_signature(None) is None


def test_signature_checks_catch_a_signature_that_misses_a_specialization(kernel, monkeypatch):
    """A caller's signature that leaves out something Triton specializes on (here n, which
    decides divisibility by 16) maps two specializations to one kernel: the checks say so."""
    monkeypatch.setattr(_launch, "_check_signatures", True)
    lying = _launch.call_signature((), ("same",))
    for n in (32, 32):
        _launch.launch(kernel, (1,), _x(), n, 0.5, True, BLOCK=16, signature=lying)
    _launch.launch(kernel, (1,), _x(), 33, 0.5, True, BLOCK=16)  # compiles n=33
    with pytest.raises(AssertionError, match="another specialization"):
        _launch.launch(kernel, (1,), _x(), 33, 0.5, True, BLOCK=16, signature=lying)


def _descriptor(dtype=torch.float16, block=(64, 64), rows=256, offset=0):
    from triton.experimental.gluon.language import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    base = torch.randn(rows * 64 + offset, dtype=torch.float32).to(dtype)[offset:]
    layout = NVMMASharedLayout.get_default_for(list(block), triton.language.float16)
    if dtype == torch.float32:
        layout = NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    return TensorDescriptor(base, [rows, 64], [64, 1], list(block), layout)


def test_tma_descriptors_are_keyed_by_what_triton_types_them_by(kernel):
    """A Gluon TensorDescriptor launches directly from its second use: keyed by element type,
    block shape and layout, not by its base, shape or strides (the launcher builds the tensor
    map from those on every call)."""
    key = _launch._runtime_key
    assert key(_descriptor()) == key(_descriptor(rows=512)) == key(_descriptor(offset=8))
    assert key(_descriptor()) != key(_descriptor(block=(128, 64)))
    assert key(_descriptor()) != key(_descriptor(dtype=torch.bfloat16))
    assert key(_descriptor()) != key(_descriptor(dtype=torch.float32))
    for rows in (256, 512):
        _launch.launch(kernel, (1,), _descriptor(rows=rows), 32, 0.5, True, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["triton", "direct"]
    assert kernel.log[1][2][9].shape == [512, 64]  # this call's descriptor reached the launcher


def test_int_signature_follows_tritons_int_specialization():
    assert _launch.int_signature(32) == _launch.int_signature(64)
    assert len({_launch.int_signature(n) for n in (1, 2, 16, 17, 2**40)}) == 4


# --- `slot=`: a plan's launch bound to its compiled kernel after the first direct launch -------


def test_a_slot_binds_the_compiled_kernel_after_the_first_direct_launch(kernel, monkeypatch):
    keys = _count_keys(monkeypatch)
    slot = _launch.launch_slot()
    for n in (32, 48, 64, 80):
        x = _x()
        _launch.launch(kernel, lambda meta: (meta["BLOCK"] * 2, 5), x, n, 0.5, True, BLOCK=16,
                       slot=slot)  # fmt: skip
    # compile (key), first direct launch (key; it binds the slot), then the slot alone
    assert len(keys) == 2
    assert kernel.compiles == 1
    assert [entry[0] for entry in kernel.log] == ["triton", "direct", "direct", "direct"]
    # the grid as evaluated once, then each call's own arguments and the bound keywords
    assert kernel.log[-1][2] == (32, 5, 1, 1234, "fn", "meta", None, None, None, x, 80, 0.5, True,
                                 16, 2)  # fmt: skip
    assert [entry[2][10] for entry in kernel.log[1:]] == [48, 64, 80]
    assert list(slot) == [0]  # one device


def test_launch_bound_launches_only_through_a_bound_slot(kernel, monkeypatch):
    """`launch_bound` makes the launch the slot's bound kernel makes, from the positional
    arguments alone; it declines (False, nothing launched) before the slot is bound, with
    signature checks on and under a profiler's hook, so the caller's `launch` runs then."""
    monkeypatch.setattr(_launch, "_check_signatures", False)
    slot = _launch.launch_slot()
    assert not _launch.launch_bound(slot, (_x(), 32, 0.5, True)) and kernel.log == []
    for _ in range(2):  # compile, then the first direct launch binds the slot
        _launch.launch(kernel, (4,), _x(), 32, 0.5, True, BLOCK=16, MODE=3, slot=slot)
    y = _x()
    assert _launch.launch_bound(slot, (y, 48, 0.25, True))
    assert [entry[0] for entry in kernel.log] == ["triton", "direct", "direct"]
    # the bound grid and keywords (BLOCK=16, MODE=3), this call's arguments
    assert kernel.log[-1][2] == (4, 1, 1, 1234, "fn", "meta", None, None, None, y, 48, 0.25, True,
                                 16, 3)  # fmt: skip
    monkeypatch.setattr(_launch, "_check_signatures", True)
    assert not _launch.launch_bound(slot, (y, 48, 0.25, True))
    monkeypatch.setattr(_launch, "_check_signatures", False)
    monkeypatch.setattr(_launch.knobs.runtime, "launch_enter_hook", lambda *args: None)
    assert not _launch.launch_bound(slot, (y, 48, 0.25, True))
    assert len(kernel.log) == 3


def test_a_slot_is_per_device(kernel, monkeypatch):
    monkeypatch.setattr(_launch, "_check_signatures", False)
    slot = _launch.launch_slot()
    for device in (0, 0, 1, 1):
        monkeypatch.setattr(_launch, "_current_device", lambda device=device: device)
        _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16, slot=slot)
    assert sorted(slot) == [0, 1]


def test_a_bound_slot_still_yields_to_profiler_hooks_and_the_switch(kernel, monkeypatch):
    monkeypatch.setattr(_launch, "_check_signatures", False)
    slot = _launch.launch_slot()
    for _ in range(2):
        _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16, slot=slot)
    assert slot
    runtime = _launch.knobs.runtime
    no_hook = runtime.launch_enter_hook
    monkeypatch.setattr(runtime, "launch_enter_hook", lambda *args: None)
    _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16, slot=slot)
    monkeypatch.setattr(runtime, "launch_enter_hook", no_hook)
    _launch.set_direct_launch(False)
    _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16, slot=slot)
    _launch.set_direct_launch(True)
    _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16, slot=slot)
    kinds = [entry[0] for entry in kernel.log]
    assert kinds == ["triton", "direct", "triton", "triton", "direct"]


def test_signature_checks_verify_what_a_slot_holds(kernel, monkeypatch):
    """With the checks on, a slotted launch takes the keyed path and compares: a slot that
    holds another kernel (a plan reused for another specialization) fails loudly."""
    monkeypatch.setattr(_launch, "_check_signatures", True)
    slot = _launch.launch_slot()
    for _ in range(3):
        _launch.launch(kernel, (1,), _x(), 32, 0.5, True, BLOCK=16, slot=slot)
    assert [entry[0] for entry in kernel.log] == ["triton", "direct", "direct"]
    _launch.launch(kernel, (1,), _x(), 33, 0.5, True, BLOCK=16)  # compiles n=33
    with pytest.raises(AssertionError, match="launch slot"):
        _launch.launch(kernel, (1,), _x(), 33, 0.5, True, BLOCK=16, slot=slot)


def test_config_slot_gives_each_autotuner_pick_its_own_part():
    slot = _launch.launch_slot()
    first, second = triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})
    part = _launch.config_slot(slot, first)
    part[0] = "bound"
    assert _launch.config_slot(slot, first) is part
    assert _launch.config_slot(slot, second) == {}
    # an entry whose id now names another config (the first one freed, its id reused) is
    # not handed out for it
    slot[id(second)] = (first, {0: "stale"})
    assert _launch.config_slot(slot, second) == {}


def test_a_constexpr_in_a_runtime_parameter_is_keyed_by_its_value(kernel):
    """`scale * LOG2E` with `LOG2E` a `tl.constexpr` is a constexpr: Triton compiles its value in,
    so two values are two kernels and one value launches directly from its second call."""
    for scale in (tl.constexpr(0.5), tl.constexpr(0.25), tl.constexpr(0.25)):
        _launch.launch(kernel, (1,), _x(), 32, scale, True, BLOCK=16)
    assert [entry[0] for entry in kernel.log] == ["triton", "triton", "direct"]
    assert kernel.compiles == 2


@pytest.mark.parametrize("causal", [False, True])
def test_every_argument_of_the_sm90_launches_has_a_key(causal, monkeypatch):
    """The Gluon kernels launch directly only if each of their runtime arguments has a key; an
    argument without one sends every call through `kernel[grid]`. Built here as on an sm_90
    GPU (the launch itself replaced: this machine cannot run Gluon), forward and backward."""
    from fusedlayers.kernels import (
        _flash_bwd_sm90,
        _flash_fwd_sm90,
        dispatch,
        set_backward_path,
        set_forward_path,
    )

    if not _flash_fwd_sm90.GLUON_AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(dispatch, "_on_sm90", lambda t: True)
    keyed = []

    def key_only(kernel, grid, *args, signature=None, slot=None, **kwargs):
        launches = _launch._KernelLaunches(kernel)
        launches.key(launches.values(args, kwargs), kwargs, 0)  # raises when one has no key
        keyed.append(kernel)

    monkeypatch.setattr(_flash_fwd_sm90, "launch", key_only)
    monkeypatch.setattr(_flash_bwd_sm90, "launch", key_only)
    previous = set_forward_path("sm90"), set_backward_path("sm90")
    try:
        from fusedlayers import flash_attn_func

        q = torch.randn(1, 128, 4, 64, dtype=torch.float16, requires_grad=True)
        k, v = (torch.randn(1, 128, 2, 64, dtype=torch.float16) for _ in range(2))
        flash_attn_func(q, k, v, causal=causal).sum().backward()
    finally:
        set_forward_path(previous[0])
        set_backward_path(previous[1])
    assert keyed == [_flash_fwd_sm90._attn_fwd_sm90, _flash_bwd_sm90._attn_bwd_sm90]


# --- a bound slot calls the C launcher where Triton's Python only passes arguments on ---------


def _wrap_handle_tensordesc(launcher, tensordesc_indices, tensordesc_meta):
    """A stand-in with the closure Triton 3.6 wraps its C launcher in for descriptor arguments."""

    def inner(*args):
        return launcher, tensordesc_indices, tensordesc_meta

    return inner


class CudaLauncher:
    """A stand-in for Triton 3.6's launcher object: records calls through its Python."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, log, descriptor_positions=()):
        self.log = log

        class CLaunch:  # a C function: no code object of its own
            def __call__(self, *args):
                log.append(("c", args))

        c_launch = CLaunch()
        metas = [{"swizzle": 128} for _ in descriptor_positions]
        self.launch = (
            _wrap_handle_tensordesc(c_launch, set(descriptor_positions), metas)
            if descriptor_positions
            else c_launch
        )

    def __call__(self, *args):
        self.log.append(("python", args))


class Descriptor:
    def __init__(self, base):
        self.base, self.block_shape, self.layout, self.padding = base, [16, 64], "swizzled", None
        self.shape, self.strides = [64, 64], [64, 1]


@pytest.fixture
def driver_36(monkeypatch):
    """Triton 3.6's NVIDIA driver as `_launch` reads it: its argument format and an encoder that
    counts the tensor maps it makes (each expands to the map, then shape and strides)."""
    encoded = []

    def make_tensordesc_arg(desc, meta):
        encoded.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr()), *desc.shape, *desc.strides]

    class Driver:
        _BASE_ARGS_FORMAT = _launch._C_LAUNCH_FORMAT

    Driver.make_tensordesc_arg = staticmethod(make_tensordesc_arg)
    monkeypatch.setattr(_launch, "_nvidia_driver", lambda: Driver)
    monkeypatch.setattr(_launch, "_check_signatures", False)
    return encoded


def _launch_through(kernel, monkeypatch, descriptor_positions, xs):
    log = []
    launcher = CudaLauncher(log, descriptor_positions)
    monkeypatch.setattr(Compiled, "run", property(lambda self: launcher))
    slot = _launch.launch_slot()
    _SLOTS.append(slot)
    for x in xs:
        _launch.launch(kernel, (2,), x, 32, 0.5, True, BLOCK=16, slot=slot)
    return log


_SLOTS: list[dict] = []  # the slots `_launch_through` made, last last


def test_a_bound_slot_calls_the_c_launcher_itself(kernel, monkeypatch, driver_36):
    xs = [_x() for _ in range(4)]
    log = _launch_through(kernel, monkeypatch, (), xs)
    # compile (Triton's path), the first direct launch through the launcher's Python (it binds
    # the slot), then the C function with the arguments that Python would have passed it
    assert [entry[0] for entry in kernel.log] == ["triton"]
    assert [entry[0] for entry in log] == ["python", "c", "c"]
    assert log[-1][1] == (2, 1, 1, 1234, "fn", False, True, None, None, "meta", None, None, None,
                          xs[-1], 32, 0.5, True, 16, 2)  # fmt: skip


def test_a_bound_slot_encodes_a_tensor_map_once_per_address(kernel, monkeypatch, driver_36):
    """Descriptors expand in place to (tensor map, shape, strides), the maps kept per address:
    three buffers used in turn are encoded once each, and each launch gets its own buffer's."""
    buffers = [_x() for _ in range(3)]
    xs = [Descriptor(buffers[i % 3]) for i in range(9)]
    log = _launch_through(kernel, monkeypatch, (0,), xs)
    # launch 1 compiles, 2 binds the slot, 3-5 encode buffers 2, 0, 1, and 6-9 reuse them
    assert [entry[0] for entry in log] == ["python"] + ["c"] * 7
    assert driver_36 == [buffers[i].data_ptr() for i in (2, 0, 1)]
    for x, (_, args) in zip(xs[2:], log[1:]):
        assert args[13:18] == (("map", x.base.data_ptr()), 64, 64, 64, 1)
        assert args[18:] == (32, 0.5, True, 16, 2)


def test_a_slot_keeps_a_bounded_number_of_tensor_maps(kernel, monkeypatch, driver_36):
    monkeypatch.setattr(_launch, "_MAX_TENSOR_MAPS", 2)
    b0, b1, b2 = (_x() for _ in range(3))
    # the slot binds on b1; then b2 and b0 fill the table, b1 empties it and is kept, b2 is
    # kept beside it, and the last b1 finds its map
    _launch_through(
        kernel, monkeypatch, (0,), [Descriptor(b) for b in (b0, b1, b2, b0, b1, b2, b1)]
    )
    assert driver_36 == [b.data_ptr() for b in (b2, b0, b1, b2)]


@pytest.mark.parametrize(
    "launcher_change",
    [
        {"global_scratch_size": 256},  # Triton's Python allocates scratch per launch
        {"profile_scratch_size": 64},
        {"launch": lambda *args: None},  # a Python wrapper of another shape
    ],
    ids=lambda change: next(iter(change)),
)
def test_a_launcher_with_more_to_do_keeps_its_python(
    kernel, monkeypatch, driver_36, launcher_change
):
    log = []
    launcher = CudaLauncher(log)
    for name, value in launcher_change.items():
        setattr(launcher, name, value)
    monkeypatch.setattr(Compiled, "run", property(lambda self: launcher))
    slot = _launch.launch_slot()
    for _ in range(4):
        _launch.launch(kernel, (2,), _x(), 32, 0.5, True, BLOCK=16, slot=slot)
    assert [entry[0] for entry in log] == ["python"] * 3


def test_another_driver_format_keeps_the_launchers_python(kernel, monkeypatch, driver_36):
    class Other:
        _BASE_ARGS_FORMAT = "iiiKKOOOO"

    monkeypatch.setattr(_launch, "_nvidia_driver", lambda: Other)
    log = _launch_through(kernel, monkeypatch, (), [_x() for _ in range(4)])
    assert [entry[0] for entry in log] == ["python"] * 3


def test_signature_checks_compare_a_kept_tensor_map_with_a_fresh_one(
    kernel, monkeypatch, driver_36
):
    """With the checks on, a slotted launch still ends in the bound call; a kept map is compared
    with a fresh encoding, so a slot whose descriptors change geometry fails loudly."""
    monkeypatch.setattr(_launch, "_check_signatures", True)
    x = Descriptor(_x())
    log = _launch_through(kernel, monkeypatch, (0,), [x] * 4)
    assert [entry[0] for entry in log] == ["python", "c", "c"]
    assert len(driver_36) == 2  # kept on the first bound launch, checked on the second
    x.strides = [128, 1]  # the same address, another geometry
    with pytest.raises(AssertionError, match="changed its geometry"):
        _launch.launch(kernel, (2,), x, 32, 0.5, True, BLOCK=16, slot=_SLOTS[-1])
