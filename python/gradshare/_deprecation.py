"""Former names that keep working after a rename, each with one DeprecationWarning per process.

One home for every alias: a renamed keyword argument (``renamed_kwargs``) or attribute (``RenamedAttribute``).
A loop that reads an old attribute at every step warns once, not at every step; tests reset ``_warned``.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, Set, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])

_warned: Set[str] = set()


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns that ``old`` is now ``new``, the first time only (per process)."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=stacklevel)


def renamed_kwargs(**renames: str) -> Callable[[F], F]:
    """Decorator: keyword arguments passed under a former name (``old="new"``) reach ``new``.

    Passing both names is a TypeError. The wrapper records the mapping in ``__renamed_kwargs__`` (for code
    that lists a function's accepted options from its signature)."""
    def decorate(fn: F) -> F:
        owner = fn.__qualname__.replace(".__init__", "")          # a class by its name, a function by its path
        owner = owner if "." in fn.__qualname__ else f"{fn.__module__}.{owner}"

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{owner}: pass {new}= or its former name {old}=, not both")
                    warn_renamed(f"{owner}({old}=...)", f"{new}=...")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        wrapper.__renamed_kwargs__ = dict(renames)  # type: ignore[attr-defined]
        return cast(F, wrapper)
    return decorate


def renamed_from(fn: Callable[..., Any]) -> Dict[str, str]:
    """The former keyword names ``fn`` still accepts (old -> new); empty when none."""
    return dict(getattr(fn, "__renamed_kwargs__", {}))


class RenamedAttribute:
    """A class attribute under a former name that reads and writes the attribute ``new``."""

    def __init__(self, new: str):
        self.new = new
        self.old = new

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.old = owner.__name__, name

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        warn_renamed(f"{self.owner}.{self.old}", f"{self.owner}.{self.new}")
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        warn_renamed(f"{self.owner}.{self.old}", f"{self.owner}.{self.new}")
        setattr(obj, self.new, value)


def former_names(module: str, **renames: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves the module's former names (``old="new"``), warning once each."""
    import sys

    def __getattr__(name: str) -> Any:
        new = renames.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_renamed(f"{module}.{name}", f"{module}.{new}")
        return getattr(sys.modules[module], new)
    return __getattr__
