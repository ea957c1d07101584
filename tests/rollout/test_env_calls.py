"""The agent loop's environment calls: one long-lived daemon thread, a turn's calls handed over at once,
each with its own deadline; a batch that overruns its deadline runs its unstarted calls at once."""

import threading
import time

from r3lightning.envs.safety import CallTimeout
from r3lightning.rollout.env_calls import EnvCaller as _EnvCaller


def test_a_batch_runs_every_call_once_in_order_in_one_daemon_thread():
    caller, seen = _EnvCaller(), []

    def record(i):
        seen.append((i, threading.current_thread().name, threading.current_thread().daemon))
        return i * 10

    assert caller.call_each([(record, (i,)) for i in range(5)], timeout_s=5.0) == [(True, i * 10) for i in range(5)]
    assert [i for i, _, _ in seen] == list(range(5))
    assert {(name, daemon) for _, name, daemon in seen} == {("r3l-env-call", True)}
    assert caller.call_each([(record, (7,))], timeout_s=5.0) == [(True, 70)]  # the same thread serves later turns


def test_errors_come_back_per_call_and_a_hung_call_times_out_alone():
    caller, release, runs = _EnvCaller(), threading.Event(), []

    def fine(i):
        runs.append(i)
        return i

    def broken():
        raise RuntimeError("verifier crashed")

    def hangs():
        release.wait(5.0)
        return "late"

    try:
        out = caller.call_each([(fine, (0,)), (broken, ()), (hangs, ()), (fine, (3,)), (fine, (4,))], timeout_s=0.2)
    finally:
        release.set()
    assert out[0] == (True, 0) and out[3:] == [(True, 3), (True, 4)]
    assert not out[1][0] and isinstance(out[1][1], RuntimeError)
    assert not out[2][0] and isinstance(out[2][1], CallTimeout)
    assert sorted(runs) == [0, 3, 4]  # the calls after the hung one ran once, on a new thread
    (ok, err), = caller.call_each([(lambda: threading.Event().wait(1.0), ())], timeout_s=0.05)
    assert not ok and isinstance(err, CallTimeout)
    assert caller.call_each([(lambda: "ok", ())], timeout_s=1.0) == [(True, "ok")]  # a new thread serves it


def test_a_batch_longer_than_the_deadline_is_fine_when_each_call_is_within_it():
    """The deadline is per call, from its own start: four calls of 0.1 s under a 0.35 s deadline take
    0.4 s together and all return (the caller first waits for the batch, then follows it call by call).
    Each call has 3.5x its own duration of margin, so a loaded machine does not fail it."""
    caller = _EnvCaller()

    def slow(i):
        time.sleep(0.1)
        return i

    assert caller.call_each([(slow, (i,)) for i in range(4)], timeout_s=0.35) == [(True, i) for i in range(4)]


def test_no_deadline_calls_directly():
    caller = _EnvCaller()
    assert caller.call_each([(lambda: threading.current_thread().name, ())], timeout_s=None) == [
        (True, threading.main_thread().name)
    ]
