"""The tutorials' one import: poptorch from the Poplar SDK, else accelbatch's CPU emulator of it."""

from __future__ import annotations

from types import ModuleType


def import_poptorch(force_emulator: bool) -> ModuleType:
    """``import poptorch``, or accelbatch's CPU emulator of it when it is missing (or when asked)."""
    if not force_emulator:
        try:
            import poptorch

            return poptorch
        except ImportError:
            print("poptorch not found (it ships with the Poplar SDK): using accelbatch's CPU emulator of poptorch")
    from accelbatch.backends import poptorch_emulator as poptorch

    return poptorch
