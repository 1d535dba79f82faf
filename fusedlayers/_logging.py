"""`FUSEDLAYERS_DEBUG=1`: say, once per call site, what the front end decided and why.

A call site is the first frame outside the fusedlayers package (the user's line), plus a tag the
caller gives (a module's name), so a model with many layers logs each layer once.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

logger = logging.getLogger("fusedlayers")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_seen: set[tuple[str, str]] = set()


def debug_enabled() -> bool:
    # Frame inspection cannot be traced; compiled graphs log nothing (the eager call did).
    if torch.compiler.is_compiling():
        return False
    return os.environ.get("FUSEDLAYERS_DEBUG", "0") not in ("", "0")


def _user_frame() -> str:
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE_DIR)
        or "torch" + os.sep in frame.f_code.co_filename
    ):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def log_decision(tag: str, message: str) -> None:
    """Log `message` the first time this (call site, tag) is seen; no-op unless debugging."""
    if not debug_enabled():
        return
    key = (_user_frame(), tag)
    if key in _seen:
        return
    _seen.add(key)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[fusedlayers] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.info("%s (%s): %s", key[0], tag, message)
