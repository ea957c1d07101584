"""Checks of restored state, each raising ``ValueError("<field>: <problem>")`` for the caller to prefix
with where the state came from (``r3lightning.training.checkpoint_state`` names the checkpoint)."""

from __future__ import annotations

import numbers
from typing import Any, Optional


def expect_int(value: Any, field: str, minimum: Optional[int] = 0, none: bool = False) -> None:
    """ValueError ``"<field>: ..."`` unless ``value`` is a whole number (>= ``minimum``), or None when ``none``."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{field}: {value!r} is not a whole number")
    if minimum is not None and value < minimum:
        raise ValueError(f"{field}: {value!r} is below {minimum}")


def expect_number(value: Any, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field}: {value!r} is not a number")


def expect_type(value: Any, kind: type | tuple[type, ...], field: str) -> None:
    """ValueError ``"<field>: ..."`` unless ``value`` is a ``kind``."""
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"{field}: a {type(value).__name__} where a {names} was expected")
