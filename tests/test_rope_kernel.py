"""The fused RoPE kernel under the CPU interpreter (CUDA when present): forward and gradient
against the PyTorch path in fp64 (attention_testing's pass rule: at most 2x, gradients 3x, the
error of the same PyTorch path fed input-dtype tensors, plus one unit), for sbhd, bshd and thd,
rotate-half and interleaved, partial rotation, start positions, strided views of a fused QKV
tensor and non-contiguous incoming gradients; torch.compile tracing; the front end's backend
choice; MultiheadAttention's switch; the benchmark script's pipeline.

The angle tables are random per channel (not RotaryPositionEmbedding's), so a channel that takes
its partner's angle, or a backward that uses the wrong sin of a pair, shows up as an error.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch
from attention_testing import check_close
from fusedlayers.kernels import _compat, _rope

import fusedlayers.layers.rope as rope_front
from fusedlayers.layers.multihead_attention import MultiheadAttention
from fusedlayers.layers.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

THD_LENGTHS, THD_PADDING = (3, 6, 1), 2  # rows after the last sequence belong to none


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 128 elements, so the test shapes span several programs (a ragged last one) and
    several head steps per program; `test_default_tile_geometry` keeps the real size."""
    monkeypatch.setattr(_rope, "_TILE", 128)


@dataclasses.dataclass(frozen=True)
class RopeCase:
    """One RoPE problem. `strided`: t is k sliced from a fused QKV tensor and read in place,
    "heads" from `[..., 3h, d]` (TE issue 1195's head split: head stride d) or "per_head" from
    `[..., h, 3, d]` (head stride 3d); the incoming gradient then has stride(-1) != 1 (the
    launcher's one copy)."""

    fmt: str = "bshd"
    b: int = 2
    s: int = 7
    h: int = 6
    d: int = 16
    d_rot: int | None = None  # None: every channel rotates
    dtype: torch.dtype = torch.float32
    interleaved: bool = False
    start: bool = False
    strided: str | None = None
    seed: int = 0

    @property
    def lead(self) -> tuple[int, ...]:
        if self.fmt == "thd":
            return (sum(THD_LENGTHS) + THD_PADDING,)
        return (self.s, self.b) if self.fmt == "sbhd" else (self.b, self.s)


def make_inputs(case: RopeCase) -> dict:
    """Fresh random t (its fused base), dy, freqs and positions for `case`, on the CPU."""
    g = torch.Generator().manual_seed(case.seed)
    lead, h, d = case.lead, case.h, case.d
    d_rot = case.d_rot or d
    fused = {None: (h, d), "heads": (3 * h, d), "per_head": (h, 3, d)}[case.strided]
    base = torch.randn(*lead, *fused, generator=g)
    dy = torch.randn(*lead, d, h, generator=g).transpose(-1, -2)  # stride(-1) == h
    if not case.strided:
        dy = dy.contiguous()
    batch = len(THD_LENGTHS) if case.fmt == "thd" else case.b
    start = torch.randint(0, 5, (batch,), generator=g, dtype=torch.int32) if case.start else None
    longest = max(THD_LENGTHS) + THD_PADDING if case.fmt == "thd" else case.s
    n_pos = longest + (5 if case.start else 0) + 2
    # Random angles per channel, of the size real positions reach (not a rotation per pair).
    freqs = (torch.rand(n_pos, 1, 1, d_rot, generator=g) - 0.5) * 4 * n_pos
    cu = torch.tensor([0, *torch.tensor(THD_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        base=base,
        dy=dy,
        freqs=freqs,
        start_positions=start,
        cu_seqlens=cu if case.fmt == "thd" else None,
    )


def _view(base: torch.Tensor, case: RopeCase) -> torch.Tensor:
    if case.strided == "heads":
        return base[..., case.h : 2 * case.h, :]
    return base[..., 1, :] if case.strided == "per_head" else base


def rope_results(case: RopeCase, inputs: dict, backend: str, dtype: torch.dtype) -> tuple:
    """(out, dt) of apply_rotary_pos_emb on `backend`, every float tensor cast to `dtype` (freqs
    stays fp32 unless dtype is fp64: the table the modules pass)."""
    t = _view(inputs["base"].to(dtype).requires_grad_(), case)
    freqs = inputs["freqs"].to(torch.float64 if dtype == torch.float64 else torch.float32)
    out = apply_rotary_pos_emb(
        t,
        freqs,
        case.fmt,
        start_positions=inputs["start_positions"],
        interleaved=case.interleaved,
        cu_seqlens=inputs["cu_seqlens"],
        backend=backend,
    )
    (dt,) = torch.autograd.grad(out, t, inputs["dy"].to(dtype))
    return out, dt


def check_rope_case(case: RopeCase, device) -> dict:
    """Kernel vs the fp64 reference, with PyTorch's own error in case.dtype as the yardstick."""
    inputs = make_inputs(case)
    inputs = {k: None if v is None else v.to(device) for k, v in inputs.items()}
    got = rope_results(case, inputs, "kernel", case.dtype)
    high = rope_results(case, inputs, "reference", torch.float64)
    low = rope_results(case, inputs, "reference", case.dtype)
    out = got[0]
    assert (
        out.dtype == case.dtype
        and out.is_contiguous()
        and out.shape == (*case.lead, case.h, case.d)
    )
    return {
        name: check_close(name, a, b, c, factor=factor)
        for name, a, b, c, factor in zip(("out", "dt"), got, high, low, (2.0, 3.0))
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("d_rot", [None, 10], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_matches_fp64_reference(device, fmt, interleaved, d_rot, dtype):
    case = RopeCase(fmt=fmt, interleaved=interleaved, d_rot=d_rot, dtype=dtype, seed=1)
    check_rope_case(case, device)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_start_positions(device, fmt, interleaved):
    """Decoding offsets per sequence: the kernel reads every token's position from a tensor."""
    case = RopeCase(fmt=fmt, interleaved=interleaved, start=True, dtype=torch.float16, seed=2)
    check_rope_case(case, device)


@pytest.mark.parametrize("strided", ["heads", "per_head"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_strided_fused_qkv_slice(device, fmt, interleaved, strided):
    """k as a slice of a fused projection output ([..., h + 2*hg, d], TE issue 1195's layout, or
    per head [..., h, 3, d]): read in place; the gradient arrives with stride(-1) != 1."""
    case = RopeCase(
        fmt=fmt, interleaved=interleaved, strided=strided, d_rot=10, dtype=torch.float16, seed=3
    )
    check_rope_case(case, device)


def test_strided_view_is_read_in_place(device, monkeypatch):
    """The kernel gets the caller's strided view itself (same storage, same first element) with
    the strides of its bshd view: no copy on the way from apply_rotary_pos_emb to the launch."""
    launched = []
    kernel = _rope._rope_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(t, *args, **kwargs):
                launched.append((t.data_ptr(), tuple(args[4:7])))  # stride_tb, _ts, _th
                return kernel[grid](t, *args, **kwargs)

            return launch

    monkeypatch.setattr(_rope, "_rope_kernel", Recording())
    case = RopeCase(fmt="sbhd", strided="heads", dtype=torch.float16)
    t = _view(make_inputs(case)["base"].to(device, case.dtype), case)
    apply_rotary_pos_emb(t, RotaryPositionEmbedding(16)(8).to(device), "sbhd", backend="kernel")
    assert launched == [(t.data_ptr(), t.transpose(0, 1).stride()[:3])]


def test_default_tile_geometry(device, monkeypatch):
    """The launch geometry the GPU uses (12 heads of 64: 4 heads x 16 tokens per tile)."""
    monkeypatch.setattr(_rope, "_TILE", 4096)
    assert _rope._geometry(12, 64, 64) == (16, 4, 32, 0)
    case = RopeCase(s=40, h=12, d=64, dtype=torch.float16, strided="heads", seed=4)
    inputs = make_inputs(case)
    got, high, low = (
        rope_results(case, inputs, backend, dtype)
        for backend, dtype in (
            ("kernel", case.dtype),
            ("reference", torch.float64),
            ("reference", case.dtype),
        )
    )
    for name, a, b, c, factor in zip(("out", "dt"), got, high, low, (2.0, 3.0)):
        check_close(name, a, b, c, factor=factor)


def _traced_targets(fn, *args) -> list[str]:
    """The targets of the nodes dynamo traces `fn(*args)` into, fullgraph."""
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    torch.compile(fn, fullgraph=True, backend=record)(*args)
    return seen


def _dense_call(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    return apply_rotary_pos_emb(t, freqs, "sbhd", backend="kernel")


def test_compile_traces_without_graph_break(device):
    """The custom ops' fake implementations let dynamo trace the dense call whole (aot_eager: the
    real kernel still runs, so compiled results match eager bitwise), and both match the
    reference."""
    torch._dynamo.reset()
    t = torch.randn(5, 2, 4, 16, device=device, requires_grad=True)
    freqs = RotaryPositionEmbedding(16)(8).to(device)
    assert "fusedlayers.rope_fwd.default" in _traced_targets(_dense_call, t, freqs)
    compiled = torch.compile(_dense_call, fullgraph=True, backend="aot_eager")
    eager_out, compiled_out = _dense_call(t, freqs), compiled(t, freqs)
    assert type(eager_out.grad_fn).__name__ == "_EagerRopeBackward"
    assert torch.equal(eager_out, compiled_out)
    reference = apply_rotary_pos_emb(t, freqs, "sbhd", backend="reference")
    torch.testing.assert_close(eager_out, reference)
    dy = torch.randn_like(eager_out)
    (eager_dt,) = torch.autograd.grad(eager_out, t, dy)
    (compiled_dt,) = torch.autograd.grad(compiled_out, t, dy)
    (reference_dt,) = torch.autograd.grad(reference, t, dy)
    assert torch.equal(eager_dt, compiled_dt)
    torch.testing.assert_close(eager_dt, reference_dt)


def _kernel_must_not_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the RoPE kernel ran")

    monkeypatch.setattr(rope_front, "rope", refuse)


def test_auto_on_cpu_takes_reference(monkeypatch):
    _kernel_must_not_run(monkeypatch)
    t = torch.randn(4, 2, 3, 8)
    out = apply_rotary_pos_emb(t, RotaryPositionEmbedding(8)(4))
    assert out.shape == t.shape
    why = rope_front._use_kernel("auto", t, RotaryPositionEmbedding(8)(4), "sbhd")
    assert why == (False, "t on cpu (no CUDA): reference path")


def test_kernel_forced_under_the_interpreter(device):
    t = torch.randn(4, 2, 3, 8, device=device, requires_grad=True)
    freqs = RotaryPositionEmbedding(8, interleaved=True)(4).to(device)
    out = apply_rotary_pos_emb(t, freqs, "sbhd", interleaved=True, backend="kernel")
    assert type(out.grad_fn).__name__ == "_EagerRopeBackward"
    want = apply_rotary_pos_emb(t, freqs, "sbhd", interleaved=True, backend="reference")
    torch.testing.assert_close(out, want)


def test_tables_computed_once_per_table_version(device, monkeypatch):
    """cos/sin of a table are computed once and reused by every call (every layer's q and k),
    and computed again after the table is edited in place: the rotation follows the edit."""
    computed = []
    cos_sin = rope_front._cos_sin
    monkeypatch.setattr(rope_front, "_cos_sin", lambda f: computed.append(f) or cos_sin(f))
    q, k = (torch.randn(2, 5, 3, 8, device=device) for _ in range(2))
    freqs = (torch.rand(6, 1, 1, 8) * 6).to(device)  # random angles, more positions than s
    rotate = dict(tensor_format="bshd", backend="kernel")
    apply_rotary_pos_emb(q, freqs, **rotate)
    apply_rotary_pos_emb(k, freqs, **rotate)
    assert len(computed) == 1
    freqs.mul_(0.5)
    edited = apply_rotary_pos_emb(q, freqs, **rotate)
    assert len(computed) == 2
    want = apply_rotary_pos_emb(q, freqs, tensor_format="bshd", backend="reference")
    torch.testing.assert_close(edited, want)
    with torch.inference_mode():  # no version counter: computed on every call
        table = freqs.clone()
        for _ in range(2):
            apply_rotary_pos_emb(q, table, **rotate)
    assert len(computed) == 4


def qk_views(case: RopeCase, groups: int, dtype: torch.dtype, device) -> tuple:
    """q [..., h, d] and k [..., g, d] sliced from one interleaved projection [..., g, h/g + 2,
    d] (q copied where its heads are not equally spaced: 1 < g < h), leaves for the grads."""
    g = torch.Generator().manual_seed(case.seed)
    per = case.h // groups
    mixed = torch.randn(*case.lead, groups, per + 2, case.d, generator=g)
    mixed = mixed.to(device, dtype).requires_grad_()
    q = mixed[..., :per, :].reshape(*case.lead, case.h, case.d)
    return mixed, q, mixed[..., per, :]


@pytest.mark.parametrize(
    "fmt, interleaved, d_rot, start, groups",
    [
        ("sbhd", False, None, False, 6),
        ("bshd", True, 10, False, 2),  # GQA: k has 2 heads, q's 6 copied out of the rows
        ("bshd", False, None, True, 1),  # MQA, decoding offsets
        ("thd", True, 10, False, 3),
        ("thd", False, None, True, 6),
    ],
)
def test_pair_equals_two_calls(device, fmt, interleaved, d_rot, start, groups):
    """rotate_qk (one launch per pass, one autograd node) gives q and k, and their gradients,
    exactly as two apply_rotary_pos_emb calls do; incoming gradients from one buffer (as the
    attention backward writes them) or from two."""
    case = RopeCase(fmt=fmt, interleaved=interleaved, d_rot=d_rot, start=start, seed=9)
    inputs = {k: v if v is None else v.to(device) for k, v in make_inputs(case).items()}
    rope = dict(
        tensor_format=fmt, start_positions=inputs["start_positions"], interleaved=interleaved,
        cu_seqlens=inputs["cu_seqlens"], backend="kernel",
    )  # fmt: skip
    for dtype in (torch.float32, torch.float16):
        for one_buffer in (False, True):
            mixed, q, k = qk_views(case, groups, dtype, device)
            pair = rope_front.rotate_qk(q, k, inputs["freqs"], **rope)
            assert type(pair[0].grad_fn).__name__ == "_EagerRopePairBackward"
            assert pair[0].grad_fn is pair[1].grad_fn
            apart = [apply_rotary_pos_emb(t, inputs["freqs"], **rope) for t in (q, k)]
            flat = torch.randn(q.numel() + k.numel(), device=device).to(dtype)
            dq_out = flat[: q.numel()].view(q.shape)
            dk_out = flat[q.numel() :].view(k.shape)
            if not one_buffer:
                dk_out = dk_out.clone()
            got = torch.autograd.grad(pair, mixed, (dq_out, dk_out))
            want = torch.autograd.grad(apart, mixed, (dq_out, dk_out))
            for a, b in zip((*pair, *got), (*apart, *want)):
                assert torch.equal(a, b)


def test_pair_falls_back_where_one_cannot_take_the_kernel(device, monkeypatch):
    """k refused by the kernel: q and k each take their own path, with their own results."""
    case = RopeCase(fmt="bshd", seed=10)
    mixed, q, k = qk_views(case, 3, torch.float32, device)
    freqs = make_inputs(case)["freqs"].to(device)
    original = rope_front._use_kernel

    def refuse_k(backend, t, *args):
        return (False, "test") if t.shape[-2] == 3 else original("kernel", t, *args)

    monkeypatch.setattr(rope_front, "_use_kernel", refuse_k)
    q_out, k_out = rope_front.rotate_qk(q, k, freqs, "bshd", backend="auto")
    assert type(q_out.grad_fn).__name__ == "_EagerRopeBackward"
    want_k = apply_rotary_pos_emb(k, freqs, "bshd", backend="reference")
    assert torch.equal(k_out, want_k)
    torch.testing.assert_close(q_out, apply_rotary_pos_emb(q, freqs, "bshd", backend="kernel"))


def _pair_call(q, k, freqs):
    return rope_front.rotate_qk(q, k, freqs, "sbhd", backend="kernel")


def test_pair_compiles_to_the_one_tensor_ops(device):
    torch._dynamo.reset()
    q = torch.randn(5, 2, 4, 16, device=device, requires_grad=True)
    k = torch.randn(5, 2, 2, 16, device=device, requires_grad=True)
    freqs = RotaryPositionEmbedding(16)(8).to(device)
    assert _traced_targets(_pair_call, q, k, freqs).count("fusedlayers.rope_fwd.default") == 2
    compiled = torch.compile(_pair_call, fullgraph=True, backend="aot_eager")(q, k, freqs)
    for a, b in zip(compiled, _pair_call(q, k, freqs)):
        assert torch.equal(a, b)


def test_freqs_requiring_grad_takes_reference(device, monkeypatch):
    """The kernel has no gradient for the table: never drop it silently."""
    t = torch.randn(4, 2, 3, 8, device=device)
    freqs = RotaryPositionEmbedding(8)(4).to(device).requires_grad_()
    with pytest.raises(ValueError, match="freqs requires grad"):
        apply_rotary_pos_emb(t, freqs, backend="kernel")
    blocker = "freqs requires grad: the kernel has no gradient for the angle table"
    assert rope_front._kernel_blocker(t, freqs, "sbhd") == blocker
    assert rope_front._use_kernel("auto", t, freqs, "sbhd")[0] is False
    with torch.no_grad():  # no gradient wanted: the kernel may take it
        assert rope_front._use_kernel("kernel", t, freqs, "sbhd") == (True, "backend='kernel'")
    _kernel_must_not_run(monkeypatch)
    (dfreqs,) = torch.autograd.grad(apply_rotary_pos_emb(t, freqs).sum(), freqs)
    assert dfreqs.abs().sum() > 0


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((torch.randn(4, 2, 3, 8, dtype=torch.float64),), {}, r"t dtype \(torch.float64\)"),
        ((torch.randn(4, 2, 3, 8), torch.randn(4, 1, 1, 8).double()), {}, "freqs dtype"),
        ((torch.randn(4, 2, 3, 8),), {"backend": "fast"}, r"backend \('fast'\) must be one of"),
        ((torch.randn(4, 3, 8),), {"tensor_format": "bshd"}, r"t has 3 dims \(\(4, 3, 8\)\)"),
    ],
)
def test_kernel_refusals_name_argument_and_value(args, kwargs, message):
    t, freqs = args[0], args[1] if len(args) > 1 else RotaryPositionEmbedding(8)(4)
    kwargs = {"backend": "kernel", **kwargs}
    with pytest.raises(ValueError, match=message):
        apply_rotary_pos_emb(t, freqs, **kwargs)


def test_kernel_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(_compat, "INTERPRETER", False)  # kernels defined for a GPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        apply_rotary_pos_emb(
            torch.randn(4, 2, 3, 8), RotaryPositionEmbedding(8)(4), backend="kernel"
        )


def test_validation_precedes_the_kernel(monkeypatch):
    """Bad input is refused on the host before any launch, with the existing messages."""
    _kernel_must_not_run(monkeypatch)
    t, freqs = torch.randn(4, 2, 3, 8), RotaryPositionEmbedding(8)(4)
    with pytest.raises(ValueError, match="RoPE table has 3 positions, position 3 requested"):
        apply_rotary_pos_emb(t, freqs[:3], backend="kernel")
    with pytest.raises(ValueError, match=r"rotary dim \(7\) must be even"):
        apply_rotary_pos_emb(t, torch.randn(4, 1, 1, 7), backend="kernel")
    with pytest.raises(ValueError, match=r"tensor_format \('sbdh'\) must be one of"):
        apply_rotary_pos_emb(t, freqs, "sbdh", backend="kernel")


def test_debug_log_names_the_path(monkeypatch, caplog):
    monkeypatch.setenv("FUSEDLAYERS_DEBUG", "1")
    t = torch.randn(4, 2, 3, 8)
    with caplog.at_level(logging.INFO, logger="fusedlayers"):
        apply_rotary_pos_emb(t, RotaryPositionEmbedding(8)(4), backend="kernel")
        apply_rotary_pos_emb(t, RotaryPositionEmbedding(8)(4))
    messages = [r.getMessage() for r in caplog.records if "(RoPE)" in r.getMessage()]
    assert len(messages) == 2
    assert messages[0].endswith("kernel: backend='kernel'")
    assert messages[1].endswith("reference: t on cpu (no CUDA): reference path")


@pytest.fixture
def rope_kernel_on_cpu(monkeypatch):
    """`auto` sends CPU tensors to the RoPE kernel (attention stays on its reference path);
    counts the launches."""
    calls = []
    original_choice = rope_front._use_kernel
    original_rope, original_pair = rope_front.rope, rope_front.rope_pair

    def choose(backend, t, freqs, tensor_format):
        return original_choice("kernel" if backend == "auto" else backend, t, freqs, tensor_format)

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original_rope(*args, **kwargs)

    def counting_pair(*args, **kwargs):
        calls.append((args[0].shape, args[1].shape))
        return original_pair(*args, **kwargs)

    monkeypatch.setattr(rope_front, "_use_kernel", choose)
    monkeypatch.setattr(rope_front, "rope", counting)
    monkeypatch.setattr(rope_front, "rope_pair", counting_pair)
    return calls


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_multihead_attention_rope_on_kernel_vs_reference(rope_kernel_on_cpu, fmt):
    """q and k go through the kernel as views of the fused projection; use_reference=True sends
    them to the PyTorch path; outputs and every gradient agree."""
    torch.manual_seed(5)
    mha = MultiheadAttention(
        32, 4, num_gqa_groups=2, kv_channels=8, fuse_qkv_params=True, qkv_format=fmt,
        rotary_pos_interleaved=True, attention_dropout=0.0,
    )  # fmt: skip
    table = RotaryPositionEmbedding(8, rotary_percent=0.5, interleaved=True)(16)
    x = torch.randn((7, 2, 32) if fmt == "sbhd" else (2, 7, 32), requires_grad=True)
    reference = copy.deepcopy(mha)
    reference.use_reference = True
    outs, grads = [], []
    for module in (mha, reference):
        out = module(x, rotary_pos_emb=table)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), [x, *module.parameters()]))
        if module is mha:  # q and k in one pair launch
            lead = (7, 2) if fmt == "sbhd" else (2, 7)
            assert rope_kernel_on_cpu == [((*lead, 4, 8), (*lead, 2, 8))]
    assert len(rope_kernel_on_cpu) == 1  # none on the reference path
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_benchmark_dry_run():
    """examples/perf/benchmark_rope.py's pipeline (strided inputs, the check against the reference,
    timing stand-in, table) on tiny CPU shapes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "perf"))
    import benchmark_rope

    table = benchmark_rope.main(["--dry-run"])
    rows = [line for line in table.splitlines() if line.startswith("| bshd") or "| sbhd" in line]
    assert len(rows) == 4 and "FAIL" not in table
