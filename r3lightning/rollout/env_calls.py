"""Every call into a suite's environments (``reset``, ``step``) goes through here: under the deadline
``agent.step_timeout_s``, with its result checked, whoever makes it (the agent loop's episodes, replays
and validation, the tokenizer's corpus, scripted warm-start data, GNT-pool verification).

``EnvCaller.call_each`` runs a batch of calls with a deadline for each; ``check_reset_result`` / ``check_step_result`` refuse malformed results
naming the suite, the environment's method, the task and what was wrong; ``SuiteCalls`` is the one-call
form for code outside the agent loop: a failed, hung or malformed call raises ``EnvCallError`` naming
the same, and is counted.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.envs.safety import CallTimeout


class EnvCallError(ValueError):
    """An environment call outside the agent loop raised, timed out or returned a malformed result."""


def check_suite(suite: TaskSuite) -> None:
    """Refuse a suite whose ``max_turns`` is not a whole number >= 1 (the episode step limit is read
    after every turn: None would end the first multi-turn episode with a TypeError)."""
    turns = getattr(suite, "max_turns", None)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(
            f"data.suite: {type(suite).__name__}.max_turns is {turns!r}; it must be a whole number >= 1 "
            "(the most turns an episode may take)"
        )


def _where(suite: Optional[TaskSuite], env: object, method: str, task: Task) -> str:
    owner = f"{type(suite).__name__}: " if suite is not None else ""
    return f"{owner}{type(env).__name__}.{method} (task {task.task_id!r})"


def check_reset_result(observation: object, env: object, task: Task, suite: Optional[TaskSuite] = None) -> str:
    """``observation`` when it is text; otherwise a ValueError naming the suite, the environment and the task."""
    if not isinstance(observation, str):
        hint = " (a gym-style (observation, info) pair?)" if isinstance(observation, tuple) else ""
        raise ValueError(
            f"{_where(suite, env, 'reset', task)} returned {type(observation).__name__}{hint}; "
            "it must return the first observation as a str"
        )
    return observation


def check_step_result(result: object, env: object, task: Task, suite: Optional[TaskSuite] = None) -> StepResult:
    """``result`` when it is a well-formed ``StepResult``; otherwise a ValueError naming the suite, the
    environment, the task and the field."""
    where = _where(suite, env, "step", task)
    if not isinstance(result, StepResult):
        hint = " (a gym-style (observation, reward, terminated, truncated, info) tuple?)" if isinstance(result, tuple) else ""
        raise ValueError(f"{where} returned {type(result).__name__}{hint}; it must return a StepResult(observation, reward, done, info)")
    if not isinstance(result.observation, str):
        raise ValueError(f"{where}: StepResult.observation is {type(result.observation).__name__}, expected str")
    if not isinstance(result.info, dict):
        raise ValueError(f"{where}: StepResult.info is {type(result.info).__name__}, expected dict")
    if not isinstance(result.done, bool) and type(result.done).__name__ != "bool_":
        raise ValueError(f"{where}: StepResult.done is {type(result.done).__name__}, expected bool")
    return result


class _CallBatch:
    """Calls a worker thread runs one after another; each is claimed (and timed from) when it starts.

    One condition guards the counters. The worker notifies when the last call returns, and after every
    return once the caller follows the calls one by one (``per_call``: some call ran long), so the
    usual batch costs the caller one wake-up (two events per call, set and waited for, made 64 calls
    take 0.61 ms; now 0.20).
    """

    def __init__(self, calls: list[tuple[Callable, tuple]]) -> None:
        self.calls = calls
        self.changed = threading.Condition()
        self.claimed = 0  # calls the worker started so far
        self.returned = 0  # calls returned so far
        self.finished = [False] * len(calls)
        self.abandoned = False  # the caller took the unstarted calls away: the worker starts no further call
        self.per_call = False  # the caller waits call by call: notify on every return
        self.start_times = [0.0] * len(calls)
        self.boxes: list[dict] = [{} for _ in calls]

    def run(self) -> None:
        while True:
            with self.changed:
                if self.abandoned or self.claimed >= len(self.calls):
                    return
                index = self.claimed
                self.claimed += 1
                self.start_times[index] = time.monotonic()
            self.run_one(index)

    def run_one(self, index: int) -> None:
        fn, args = self.calls[index]
        try:
            self.boxes[index]["value"] = fn(*args)
        except BaseException as err:  # handed to the caller's thread
            self.boxes[index]["error"] = err
        with self.changed:
            self.finished[index] = True
            self.returned += 1
            if self.per_call or self.returned == len(self.calls):
                self.changed.notify_all()


class EnvCaller:
    """Every environment call runs in a daemon thread, its exceptions reach the caller, and past
    ``timeout_s`` (counted from its own start) it is abandoned with ``CallTimeout`` (a hung reward
    function, math-verify on adversarial input or a stuck simulator, is left behind rather than
    blocking training; Python cannot kill a thread, so the caller drops the environment it was
    using). One long-lived thread serves the calls, and ``call_each`` hands it a whole
    turn's calls at once: starting a thread per call cost ~0.3-1 ms on a busy 2-core machine, and even a
    hand-off per call (~0.3 ms there: two thread wake-ups) was a per-episode cost no batch size shrinks.

    When the batch is not back within ``timeout_s``, the calls the thread has not started yet each get a
    thread of their own at once, so a turn's hanging calls cost one deadline together (two at most: the
    batch's, then theirs), not one each. The long-lived thread is then given up (it exits once its call
    returns, if ever); the next batch starts a new one.
    """

    def __init__(self) -> None:
        self._inbox: Optional[queue.SimpleQueue] = None

    @staticmethod
    def _serve(inbox: queue.SimpleQueue) -> None:
        while True:
            batch = inbox.get()
            if batch is None:
                return
            batch.run()
            if batch.abandoned:
                return

    def call_each(self, calls: list[tuple[Callable, tuple]], timeout_s: Optional[float]) -> list[tuple[bool, object]]:
        """``(True, result)`` or ``(False, exception)`` for every ``(fn, args)``, in order."""
        if timeout_s is None:
            out: list[tuple[bool, object]] = []
            for fn, args in calls:
                try:
                    out.append((True, fn(*args)))
                except Exception as err:  # noqa: BLE001 - handed back like a worker's exception
                    out.append((False, err))
            return out
        if not calls:
            return []
        batch = _CallBatch(calls)
        if self._inbox is None:
            self._inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._inbox,), daemon=True, name="r3l-env-call").start()
        self._inbox.put(batch)
        return self._collect(batch, timeout_s)

    def _collect(self, batch: _CallBatch, timeout_s: float) -> list[tuple[bool, object]]:
        """Outcomes of ``batch``'s calls in order. First one wait for the whole batch; if it is not back
        within ``timeout_s``, the unstarted calls start at once on threads of their own and every call is
        followed, each abandoned ``timeout_s`` after its own start."""
        out: list[tuple[bool, object]] = []
        with batch.changed:
            if not batch.changed.wait_for(lambda: batch.returned == len(batch.calls), timeout_s):
                batch.per_call, batch.abandoned = True, True
                self._inbox = None
                for index in range(batch.claimed, len(batch.calls)):
                    batch.start_times[index] = time.monotonic()
                    threading.Thread(target=batch.run_one, args=(index,), daemon=True, name="r3l-env-call").start()
            for index, (fn, _) in enumerate(batch.calls):
                left = timeout_s - (time.monotonic() - batch.start_times[index])
                if not batch.changed.wait_for(lambda: batch.finished[index], max(left, 0.0)):
                    out.append((False, CallTimeout(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout_s}s")))
                    continue
                box = batch.boxes[index]
                if "error" in box and not isinstance(box["error"], Exception):
                    raise box["error"]  # KeyboardInterrupt, SystemExit... are not the environment's failure
                out.append((False, box["error"]) if "error" in box else (True, box.get("value")))
        return out

    def __del__(self) -> None:
        if self._inbox is not None:
            self._inbox.put(None)


class SuiteCalls:
    """One environment call at a time for code outside the agent loop (the tokenizer's corpus,
    scripted warm-start data, GNT-pool verification), with the agent loop's deadline and checks.

    A call that raises, misses ``timeout_s`` or returns a malformed result raises ``EnvCallError``
    naming ``purpose``, the suite, the environment's method, the task and what went wrong; ``failures``
    counts them (for callers that skip the task and go on).
    """

    def __init__(self, suite: TaskSuite, timeout_s: Optional[float], purpose: str, caller: Optional[EnvCaller] = None) -> None:
        self.suite = suite
        self.timeout_s = timeout_s
        self.purpose = purpose
        self.failures = 0
        self._caller = caller or EnvCaller()

    def reset(self, env: object, task: Task) -> str:
        """``env.reset(task)``, checked."""
        return self._call(env, "reset", task, task, check_reset_result)

    def step(self, env: object, task: Task, action: str) -> StepResult:
        """``env.step(action)`` of an environment reset with ``task``, checked."""
        return self._call(env, "step", task, action, check_step_result)

    def _call(self, env: object, method: str, task: Task, argument: object, check: Callable) -> object:
        [(ok, value)] = self._caller.call_each([(getattr(env, method), (argument,))], self.timeout_s)
        try:
            if not ok:
                raise ValueError(f"{_where(self.suite, env, method, task)} failed: {type(value).__name__}: {value}")
            return check(value, env, task, self.suite)
        except ValueError as err:
            self.failures += 1
            raise EnvCallError(f"{self.purpose}: {err}") from None
