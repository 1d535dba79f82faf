"""The `use_reference` switch shared by every module.

`use_reference` is a constructor argument and a settable attribute; setting it on a module sets it
on every descendant that has the switch, so `model.use_reference = True` flips a whole model.
`reference_mode()` does the same for a `with` block without touching the modules.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()


def reference_mode_active() -> bool:
    """True inside a `reference_mode()` block (per thread)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def reference_mode():
    """Run every fusedlayers module on its pure-PyTorch reference path inside the block."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


class ReferenceSwitch(torch.nn.Module):
    """Base for modules with a reference path. Subclasses call `super().__init__()` first and
    read `self.reference_active` to pick their path."""

    def __init__(self, use_reference: bool = False) -> None:
        super().__init__()
        self.__dict__["_use_reference"] = bool(use_reference)

    @property
    def use_reference(self) -> bool:
        return self.__dict__["_use_reference"]

    @use_reference.setter
    def use_reference(self, value: bool) -> None:
        for module in self.modules():
            if isinstance(module, ReferenceSwitch):
                module.__dict__["_use_reference"] = bool(value)

    @property
    def reference_active(self) -> bool:
        """Whether this call should take the reference path (switch or `reference_mode()`)."""
        return self.use_reference or reference_mode_active()
