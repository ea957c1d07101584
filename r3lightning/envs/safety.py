"""Run untrusted environment / reward code with a deadline and without letting it crash training."""

from __future__ import annotations

import threading
from typing import Any, Callable


class CallTimeout(Exception):
    """The call did not return within its deadline."""


def call_with_timeout(fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)``; raise ``CallTimeout`` after ``timeout_s`` seconds.

    The call runs in a daemon thread so a hung reward function (math-verify on adversarial input, a
    stuck simulator) is abandoned rather than blocking training; Python cannot kill a thread, so the
    caller must drop the object the call was using. Exceptions from ``fn`` are re-raised here.
    ``timeout_s=None`` calls directly.
    """
    if timeout_s is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # re-raised in the caller's thread below
            box["error"] = err

    worker = threading.Thread(target=target, daemon=True, name="r3l-env-call")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise CallTimeout(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout_s}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")
