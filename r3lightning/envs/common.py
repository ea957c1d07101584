"""Helpers shared by the environment adapters: optional imports, command normalization, the task streams'
seeds and epoch shuffles, finite-dataset indexing and the simulator pool (TextWorld, ScienceWorld,
ALFWorld, procedural world, math sources).
"""

from __future__ import annotations

import hashlib
import importlib
import random
import re
import threading
import weakref
from collections.abc import Callable, Hashable
from functools import lru_cache
from typing import Any

ENVS_EXTRA_HINT = "pip install 'r3lightning[envs]'"
ACTION_TAG = re.compile(r"<action>(.*?)</action>", flags=re.DOTALL | re.IGNORECASE)


def import_optional(name: str, purpose: str = "") -> Any:
    """Import an optional package, or raise an ImportError that names the ``envs`` extra."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        top = name.split(".")[0]
        what = f" ({purpose})" if purpose else ""
        raise ImportError(
            f"The '{top}' package is needed{what} but could not be imported ({err}). "
            f"Install the environments extra: {ENVS_EXTRA_HINT}"
        ) from err


def normalize_command(text: str) -> str:
    """The command in a response: the first ``<action>`` block if any, lowercased, spaces collapsed,
    without a trailing period (the game engines' parsers are lowercase)."""
    found = ACTION_TAG.search(text)
    command = found.group(1) if found else text
    return " ".join(command.lower().split()).rstrip(".")


def valid_actions_line(actions: list[str]) -> str:
    return f"Valid actions: {', '.join(actions)}."


def split_seed(suite_seed: int, split: str, index: int, bits: int = 30) -> int:
    """Generation seed of item ``index`` of ``split``, a stable function of its arguments (SHA-256, the
    same in every process): ``2 * h + parity`` with ``h`` the first ``bits`` bits of the digest, even
    for "train" and odd otherwise, so the splits never share a seed. The default 30 bits keeps seeds
    below 2**31 (TextWorld seeds numpy, which takes 32-bit seeds); the procedural world uses 56."""
    digest = hashlib.sha256(f"{suite_seed}:{split}:{index}".encode()).digest()
    size = (bits + 7) // 8
    return 2 * (int.from_bytes(digest[:size], "big") >> (8 * size - bits)) + (0 if split == "train" else 1)


def derive_seed(*parts: Any) -> int:
    """A 32-bit seed that is a stable function of ``parts`` (blake2b of their ``repr``; unlike ``hash``,
    the same in every process). 32 bits because some generators hand the seed to numpy, which rejects
    larger ones. ``split_seed`` is the other construction: every recorded task stream was drawn with one
    of the two, so neither can change without changing the tasks a seeded run trains on."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@lru_cache(maxsize=16)  # readers move forward through epochs: a few per suite cover a batch straddling one
def shuffled_range(key: int | str, n: int) -> tuple[int, ...]:
    """``range(n)`` shuffled by ``random.Random(key)``: the order of one epoch of a finite dataset."""
    order = list(range(n))
    random.Random(key).shuffle(order)
    return tuple(order)


def finite_index(seed: int, index: int, n: int) -> int:
    """Item of a finite dataset of ``n`` items for stream position ``index``: each pass over the data
    (epoch ``index // n``) is a fresh shuffle seeded by (``seed``, epoch)."""
    if index < 0:
        raise ValueError(f"train_task index must be >= 0, got {index}")
    if n <= 0:
        raise ValueError("the training split is empty")
    return shuffled_range(f"{seed}:epoch:{index // n}", n)[index % n]


class SimulatorPool:
    """Started simulators kept for reuse across episodes, keyed by what they have loaded.

    The agent loop makes one environment per episode; starting a simulator (a JVM, a Z-machine, a PDDL
    planner state) costs 0.5-3 s, so environments lease one from their suite's pool on ``reset`` and
    give it back when the episode ends or the environment is garbage-collected. ``key`` is what must
    match for reuse (a game file), or None when any simulator serves any task. At most ``max_idle``
    idle simulators are kept; more are closed.
    """

    def __init__(self, start: Callable[[Hashable], Any], close: Callable[[Any], None] = lambda sim: None,
                 max_idle: int = 64) -> None:
        self._start = start
        self._close = close
        self.max_idle = max_idle
        self._idle: list[tuple[Hashable, Any]] = []
        self._lock = threading.Lock()
        self.started = 0

    def acquire(self, key: Hashable) -> Any:
        with self._lock:
            for i, (k, sim) in enumerate(self._idle):
                if k == key:
                    del self._idle[i]
                    return sim
            self.started += 1
        return self._start(key)

    def release(self, key: Hashable, sim: Any) -> None:
        evicted = []
        with self._lock:
            self._idle.append((key, sim))
            while len(self._idle) > self.max_idle:
                evicted.append(self._idle.pop(0)[1])
        for old in evicted:
            self.discard(old)

    def discard(self, sim: Any) -> None:
        try:
            self._close(sim)
        except Exception:  # a broken simulator must not take the caller down
            pass

    @property
    def idle(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, sim in idle:
            self.discard(sim)


class Lease:
    """One environment's hold on a pooled simulator; returned on ``release`` or when the owning
    environment is garbage-collected. A simulator whose call never returned (``busy``, e.g. abandoned
    by the agent loop's step timeout) is never reused."""

    def __init__(self, pool: SimulatorPool) -> None:
        self.pool = pool
        self.key: Hashable = None
        self.sim: Any = None
        self.busy = False

    def acquire(self, key: Hashable) -> Any:
        self.release()
        self.sim, self.key = self.pool.acquire(key), key
        return self.sim

    def release(self) -> None:
        sim, self.sim = self.sim, None
        if sim is None:
            return
        if self.busy:
            return  # a thread may still be inside it
        self.pool.release(self.key, sim)


def attach_lease(owner: object, pool: SimulatorPool) -> Lease:
    """A lease that goes back to ``pool`` when ``owner`` is garbage-collected."""
    lease = Lease(pool)
    weakref.finalize(owner, lease.release)
    return lease


def close_simulator(env: Any) -> None:
    """Pool callback for simulators with a plain ``close()`` (TextWorld and ALFWorld games)."""
    env.close()
