"""Layer-by-layer comparison of a model's kernel path against its reference path.

    report = compare_with_reference(model, batch, loss_fn=...)
    print(report)                  # one row per module, first divergence and first NaN/Inf named
    report.first_divergence        # "layers.2.self_attention" or None

The model runs twice on the same inputs and seed with dropout off (`eval()`): once with every
`use_reference` switch off, once with every switch on. Forward hooks record each watched module's
output, tensor hooks the gradient arriving at it, and `torch.autograd.grad` the parameter gradients
(`.grad` is left untouched). Any model built from fusedlayers modules works.

How a divergence is localized:
- forward: the first watched module, in order of *completion*, whose output is over tolerance (an
  inner module completes before the layer containing it, so the innermost culprit is named);
- backward, when every output agrees: among modules whose incoming output-gradient agrees but
  whose parameter gradients do not, the one that *started* last (deepest, nearest the loss);
- NaN/Inf: the first recorded tensor (forward, then backward) holding one, with its index.

Without CUDA there is no kernel pass: the modules take the reference path for CPU tensors
whatever their switches say, so both passes compute the same thing. The report then says so
(`reference_only`, a first line `NO KERNEL RAN: ...` and a `NoKernelWarning`) instead of
presenting its zeros as a kernel-vs-reference comparison; the only differences it can show come
from hooks acting on the kernel pass (the tests plant faults that way).

`debug_enabled()` says whether `FUSEDLAYERS_DEBUG=1` asks for debug checks: a model may make
costly checks of its own then (the GPT reads its token ids' range on CUDA only in debug mode).
"""

from __future__ import annotations

import contextlib
import math
import os
import textwrap
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ._logging import debug_enabled
from .reference_switch import ReferenceSwitch, reference_mode_active

__all__ = ["DebugReport", "NoKernelWarning", "compare_with_reference", "debug_enabled"]

# (atol, rtol) by compared dtype; a tensor is over tolerance when
# max|kernel - reference| > atol + rtol * max|reference|.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-4, 1e-3),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}
PATHS = ("kernel", "reference")


class NoKernelWarning(UserWarning):
    """`compare_with_reference` ran no kernel: both passes took the reference path."""


@dataclass
class Diff:
    """Max absolute difference and max-normalized relative difference of two tensors."""

    max_abs: float
    max_rel: float
    over: bool

    def __str__(self) -> str:
        return f"{self.max_abs:9.2e} {self.max_rel:9.2e}{' !' if self.over else '  '}"


@dataclass
class ModuleRecord:
    """One watched module: its diffs (None where that quantity does not exist)."""

    name: str
    kind: str
    output: Diff | None = None
    grad_output: Diff | None = None
    param_grad: Diff | None = None


@dataclass
class DebugReport:
    """Result of `compare_with_reference`; `str()` gives a readable table."""

    records: list[ModuleRecord]
    loss: dict[str, float]
    first_forward: str | None
    first_backward: str | None
    nonfinite: str | None
    tolerances: dict[torch.dtype, tuple[float, float]] = field(repr=False)
    # Why the kernel pass ran no kernel (both passes took the reference path); None when the
    # kernel pass could take the kernels.
    reference_only: str | None = None

    @property
    def first_divergence(self) -> str | None:
        """The module to look at first: forward culprit, else backward culprit."""
        return self.first_forward or self.first_backward

    def __str__(self) -> str:
        width = max([len(r.name) for r in self.records] + [6])
        head = f"{'module':<{width}}  {'output abs/rel':>21}  {'grad-out abs/rel':>21}"
        lines = []
        if self.reference_only:
            note = f"NO KERNEL RAN: {self.reference_only}"
            lines += textwrap.wrap(note, width=100, subsequent_indent="  ")
        lines.append(head + f"  {'param-grad abs/rel':>21}")
        for r in self.records:
            cells = [str(d) if d else f"{'-':>21}" for d in (r.output, r.grad_output, r.param_grad)]
            lines.append(f"{r.name:<{width}}  " + "  ".join(cells))
        kernel = "'kernel' pass (reference path)" if self.reference_only else "kernel"
        lines.append(
            f"loss: {kernel} {self.loss['kernel']:.6g}, reference {self.loss['reference']:.6g}"
        )
        lines.append(f"first over tolerance (forward):  {self.first_forward or 'none'}")
        lines.append(f"first over tolerance (backward): {self.first_backward or 'none'}")
        lines.append(f"first NaN/Inf: {self.nonfinite or 'none'}")
        return "\n".join(lines)


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        return next((t for t in map(_first_tensor, x) if t is not None), None)
    return None


def _diff(a: torch.Tensor, b: torch.Tensor, tols: dict) -> Diff:
    """a: kernel path, b: reference path, same shape; compared in fp64."""
    atol, rtol = tols.get(b.dtype, tols[torch.float32])
    a64, b64 = a.double(), b.double()
    err = (a64 - b64).abs()
    # NaN compares false everywhere, so a NaN on one side shows as an infinite difference.
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    max_abs = err.max().item() if err.numel() else 0.0
    scale = b64.abs().max().item() if b64.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return Diff(max_abs, max_rel, not max_abs <= atol + rtol * scale)


def _nonfinite_at(t: torch.Tensor) -> str | None:
    bad = ~torch.isfinite(t)
    if not bad.any():
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    return f"{t[index].item()} at index {list(index)} of shape {list(t.shape)}"


class _Recorder:
    """Hooks on the watched modules for one pass: outputs, start/finish order, output grads."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self.grad_outputs: dict[str, torch.Tensor] = {}
        self.started: list[str] = []
        self.finished: list[str] = []
        self.grad_order: list[str] = []
        self._handles = []
        for name, module in modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str) -> Callable:
        return lambda module, args: self.started.append(name)

    def _post(self, name: str) -> Callable:
        def hook(module, args, output):
            out = _first_tensor(output)
            if out is None:
                return
            self.outputs[name] = out.detach().clone()
            self.finished.append(name)
            if out.requires_grad:
                out.register_hook(lambda g: self._grad(name, g))

        return hook

    def _grad(self, name: str, grad: torch.Tensor) -> None:
        self.grad_outputs[name] = grad.detach().clone()
        self.grad_order.append(name)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@contextlib.contextmanager
def _switches(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """Set every `use_reference` switch in `model`, restoring each one's own value after."""
    saved = {m: m.use_reference for m in model.modules() if isinstance(m, ReferenceSwitch)}
    for m in saved:
        m.__dict__["_use_reference"] = on
    try:
        yield
    finally:
        for m, value in saved.items():
            m.__dict__["_use_reference"] = value


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from _tensors(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _tensors(item)


def reference_only_reason(model: torch.nn.Module, inputs: Any) -> str | None:
    """Why a pass with every `use_reference` switch off would still run no kernel (None when it
    can run them): inside `reference_mode()`, or with no CUDA tensor among `model`'s parameters
    and buffers and `inputs`, since the modules send only CUDA tensors to the kernels."""
    if reference_mode_active():
        where = (
            "compare_with_reference was called inside reference_mode(), which puts every module "
            "on the reference path"
        )
        fix = "call it outside that block"
    else:
        tensors = [*model.parameters(), *model.buffers(), *_tensors(inputs)]
        if any(t.is_cuda for t in tensors):
            return None
        devices = ", ".join(sorted({str(t.device) for t in tensors})) or "cpu"
        where = (
            f"the model and its inputs are on {devices}, where the modules take the PyTorch "
            "reference path whatever their use_reference switches say"
        )
        functional = (
            "the functional API (flash_attn_func and the other flash_attn_* functions) runs the "
            "Triton kernels on CPU tensors under the interpreter"
        )
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            here = f"TRITON_INTERPRET=1 is set, so {functional} (compare with attention_reference)"
        else:
            here = f"export TRITON_INTERPRET=1 before Python starts and {functional}"
        fix = f"compare on a CUDA device; on this machine, {here}"
    return (
        f"{where}: both passes ran the PyTorch reference path, so the comparison is empty "
        "(reference against itself; only hooks acting on the kernel pass, such as a planted "
        f"fault, can differ). To test the kernels, {fix}."
    )


def _run(model, args, kwargs, loss_fn, watched, on, seed):
    """One pass; returns (recorder, loss, {param name: grad})."""
    recorder = _Recorder(watched)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    try:
        with _switches(model, on):
            torch.manual_seed(seed)
            loss = loss_fn(model(*args, **kwargs))
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    finally:
        recorder.remove()
    param_grads = {n: g for (n, _), g in zip(named, grads) if g is not None}
    return recorder, float(loss.detach()), param_grads


def _default_loss(seed: int) -> Callable[[Any], torch.Tensor]:
    """Sum of the output against fixed random weights: every element gets a random gradient."""

    def loss_fn(output):
        out = _first_tensor(output)
        gen = torch.Generator(device=out.device).manual_seed(seed + 1)
        w = torch.randn(out.shape, generator=gen, device=out.device, dtype=torch.float32)
        return (out.float() * w).sum()

    return loss_fn


def compare_with_reference(
    model: torch.nn.Module,
    batch: Any,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    watch: Callable[[str, torch.nn.Module], bool] | None = None,
    tolerances: dict[torch.dtype, tuple[float, float]] | None = None,
    seed: int = 0,
) -> DebugReport:
    """Run `model` on its kernel path and on its reference path and compare module by module.

    batch: a tensor (one positional input), a tuple (positional inputs) or a dict (keywords).
    loss_fn: output -> scalar to differentiate (default: output against fixed random weights).
    watch: (name, module) -> bool choosing the modules to record; default: every fusedlayers
        module (anything with a `use_reference` switch) except `model` itself.
    tolerances: {dtype: (atol, rtol)} overriding `DEFAULT_TOLERANCES`.

    When the kernel pass can run no kernel (no CUDA tensors, see `reference_only_reason`), the
    comparison still runs, warns (`NoKernelWarning`) and says why in `report.reference_only`.
    """
    if watch is None:
        watch = lambda name, m: bool(name) and isinstance(m, ReferenceSwitch)
    watched = {n: m for n, m in model.named_modules() if watch(n, m)}
    tols = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    args, kwargs = (
        ((), batch)
        if isinstance(batch, dict)
        else (batch, {})
        if isinstance(batch, tuple)
        else ((batch,), {})
    )
    loss_fn = loss_fn or _default_loss(seed)
    reference_only = reference_only_reason(model, (args, kwargs))
    if reference_only:
        warnings.warn(f"no kernel ran: {reference_only}", NoKernelWarning, stacklevel=2)
    was_training = model.training
    model.eval()  # dropout off: both paths must see the same function
    try:
        runs = {
            path: _run(model, args, kwargs, loss_fn, watched, path == "reference", seed)
            for path in PATHS
        }
    finally:
        model.train(was_training)
    return _build_report(model, watched, runs, tols, reference_only)


def _build_report(model, watched, runs, tols, reference_only) -> DebugReport:
    (kern, k_loss, k_grads), (ref, r_loss, r_grads) = runs["kernel"], runs["reference"]
    records = []
    for name in ref.finished:
        rec = ModuleRecord(name, type(watched[name]).__name__)
        if name in kern.outputs:
            rec.output = _diff(kern.outputs[name], ref.outputs[name], tols)
        if name in kern.grad_outputs and name in ref.grad_outputs:
            rec.grad_output = _diff(kern.grad_outputs[name], ref.grad_outputs[name], tols)
        own = [n for n, _ in watched[name].named_parameters(prefix=name)]
        pairs = [(k_grads[n], r_grads[n]) for n in own if n in k_grads and n in r_grads]
        if pairs:
            rec.param_grad = _diff(
                torch.cat([a.reshape(-1) for a, _ in pairs]),
                torch.cat([b.reshape(-1) for _, b in pairs]),
                tols,
            )
        records.append(rec)
    first_forward = next((r.name for r in records if r.output and r.output.over), None)
    start = {n: i for i, n in enumerate(ref.started)}
    # Once an output differs, every gradient downstream of it differs too: only a clean forward
    # pass lets the backward comparison point at one module.
    suspects = [
        r.name
        for r in records
        if first_forward is None
        and r.param_grad
        and r.param_grad.over
        and not (r.grad_output and r.grad_output.over)
    ]
    first_backward = max(suspects, key=start.__getitem__) if suspects else None
    return DebugReport(
        records=records,
        loss={"kernel": k_loss, "reference": r_loss},
        first_forward=first_forward,
        first_backward=first_backward,
        nonfinite=_first_nonfinite(runs),
        tolerances=tols,
        reference_only=reference_only,
    )


def _first_nonfinite(runs) -> str | None:
    """First NaN/Inf in forward completion order, then in backward (gradient arrival) order."""
    for kind, order, store in (
        ("output", "finished", "outputs"),
        ("gradient of output", "grad_order", "grad_outputs"),
    ):
        for name in getattr(runs["reference"][0], order):
            for path in PATHS:
                tensor = getattr(runs[path][0], store).get(name)
                where = None if tensor is None else _nonfinite_at(tensor)
                if where:
                    return f"{name} ({kind}, {path} path): {where}"
    return None
