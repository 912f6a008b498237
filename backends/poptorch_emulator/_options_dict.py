"""The option dictionaries behind ``poptorch.Options`` and its categories: fixed keys, typed values, freezing
(PopTorch python/_options_impl.py ``OptionsDict``)."""

from __future__ import annotations

import copy
from typing import Any

from ._options_names import missing_option

FROZEN_MESSAGE = "Can't modify frozen Options"


class _OptionsDict:
    """A dictionary of options whose keys are fixed at construction and which can be frozen."""

    def __init__(self, **defaults: Any) -> None:
        object.__setattr__(self, "_frozen", False)
        object.__setattr__(self, "_disabled_warnings", set())
        object.__setattr__(self, "_values", dict(defaults))

    # -- freezing ---------------------------------------------------------------------------------
    def _sub_options(self) -> list[Any]:
        return [v for v in vars(self).values() if callable(getattr(v, "_set_frozen", None))]

    def _set_frozen(self, frozen: bool) -> None:
        object.__setattr__(self, "_frozen", frozen)
        for child in self._sub_options():
            child._set_frozen(frozen)

    def _freeze(self) -> None:
        self._set_frozen(True)

    def _unfreeze(self) -> None:
        self._set_frozen(False)

    def checkIsFrozen(self, option: str | None = None) -> None:
        if self._frozen:
            raise AttributeError(FROZEN_MESSAGE)

    # -- values -----------------------------------------------------------------------------------
    def set(self, **kwargs: Any) -> "_OptionsDict":
        self.checkIsFrozen()
        for option, value in kwargs.items():
            if option not in self._values:
                raise AssertionError(
                    "Invalid option %s, valid options are %s" % (option, self._values.keys()))
            expected = type(self._values[option])
            if not isinstance(value, expected):
                raise AssertionError(
                    "Unexpected type %s for option %s. Expected %s" % (type(value), option, expected))
            self._values[option] = value
        return self

    def createOrSet(self, **kwargs: Any) -> "_OptionsDict":
        self.checkIsFrozen()
        for option, value in kwargs.items():
            if option in self._values:
                self.set(**{option: value})
            else:
                self._values[option] = value
        return self

    def exists(self, option: str) -> bool:
        return option in self._values

    def deleteIfExists(self, option: str) -> None:
        self.checkIsFrozen()
        self._values.pop(option, None)

    def update(self, other: dict[str, Any]) -> dict[str, Any]:
        """Add these options to ``other`` (which must not hold any of them) and return it."""
        assert not set(self._values.keys()).intersection(other), \
            "Can't merge dictionaries, they have some keys in common"
        other.update(self._values)
        return other

    def toDict(self) -> dict[str, Any]:
        return dict(self._values)

    def __getattr__(self, option: str) -> Any:
        # Only called when normal lookup fails: public names are option values.
        values = self.__dict__.get("_values")
        if values is None or option.startswith("_") or option not in values:
            # PopTorch's text for a misspelling; a PopTorch 3.3 name not emulated here is said to be one
            raise missing_option(type(self).__name__, option)
        return values[option]

    def __setattr__(self, option: str, value: Any) -> None:
        self.checkIsFrozen(option)
        if option.startswith("_"):
            object.__setattr__(self, option, value)
        else:
            self.set(**{option: value})

    def __call__(self, option: str) -> Any:
        return getattr(self, option)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_OptionsDict":
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        for key, val in vars(self).items():
            object.__setattr__(new, key, False if key == "_frozen" else copy.deepcopy(val, memo))
        return new

    def __getstate__(self) -> dict[str, Any]:
        return dict(vars(self))

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, val in state.items():
            object.__setattr__(self, key, val)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"{type(self).__name__}({body})"


__all__ = ["FROZEN_MESSAGE", "_OptionsDict"]
