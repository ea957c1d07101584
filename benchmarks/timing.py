"""Wall time of a method's calls, for the benchmarks that split a loop or a training step into parts."""

from __future__ import annotations

import time
from typing import Any, Callable


def time_calls(obj: Any, name: str, record: Callable[..., None]) -> None:
    """Replace ``obj.name`` by a wrapper that, after each call that returns, calls
    ``record(seconds, result, *args, **kwargs)`` with the call's wall time, its result and its arguments."""
    call = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = call(*args, **kwargs)
        record(time.perf_counter() - start, result, *args, **kwargs)
        return result

    setattr(obj, name, timed)


def add_seconds(timings: dict[str, float], part: str) -> Callable[..., None]:
    """A ``record`` for ``time_calls`` that adds each call's seconds to ``timings[part]``."""

    def record(seconds: float, *_: Any, **__: Any) -> None:
        timings[part] += seconds

    return record
