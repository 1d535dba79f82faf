"""The exception the front end raises for a bad argument.

TransformerEngine and Python's convention say `ValueError` / `TypeError`; flash-attn's kernels
check their arguments in C++ and raise `RuntimeError`. Code written for either catches its own
type, so one class is both: `ArgumentError` is a `ValueError` and a `RuntimeError`, and
`ArgumentTypeError` (a wrong type or dtype) is also a `TypeError`. The message names the argument
and its value.
"""

from __future__ import annotations


class ArgumentError(ValueError, RuntimeError):
    """An invalid argument, found before any kernel runs."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type or dtype, found before any kernel runs."""


__all__ = ["ArgumentError", "ArgumentTypeError"]
