"""Stand-in for ``poptorch.poptorch_core``: the exception types PopTorch raises.

Real PopTorch raises ``poptorch.Error`` (an alias of ``poptorch.poptorch_core.Error``) for the errors it
detects in Python, with the text ``"'poptorch_py_error': <message>"`` and the attributes ``type``,
``message`` and ``location``. The emulator raises the same type with the same text, so code that catches
``poptorch.Error`` or matches the message behaves the same on the emulator and on an IPU.
"""

from __future__ import annotations

PY_ERROR_TYPE = "poptorch_py_error"
POPART_ERROR_TYPE = "popart_exception"


class Error(RuntimeError):
    """An error reported by PopTorch (``poptorch.Error``)."""

    type: str = PY_ERROR_TYPE
    message: str = ""
    location: str = ""


class RecoverableError(Error):
    """An error after which the device can be used again (``poptorch.RecoverableError``)."""


class UnrecoverableError(Error):
    """An error after which the device must be reset (``poptorch.UnrecoverableError``)."""


def py_error(message: str, error_type: str = PY_ERROR_TYPE) -> Error:
    """The exception PopTorch builds for an error found on the Python side (or, with ``error_type``
    ``"popart_exception"``, one PopART raised while compiling)."""
    err = Error(f"'{error_type}': {message}")
    err.type = error_type
    err.message = message
    err.location = ""
    return err


def compiler_error(message: str) -> Error:
    """An error PopTorch's compiler (C++) raises: ``poptorch.Error`` with the bare message."""
    err = Error(message)
    err.message = message
    return err


def popart_error(message: str) -> Error:
    """An error of PopART's (``type`` ``"popart_exception"``), as PopTorch passes it on."""
    return py_error(message, POPART_ERROR_TYPE)
