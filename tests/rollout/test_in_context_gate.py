"""R³ in-context reflection's premise gate: in-context success beside the plain samples' success on the
same qualifying tasks, in the same step (issue 62)."""

import random
from types import SimpleNamespace

import pytest

from r3lightning.engines.base import SamplingParams
from r3lightning.envs.base import Task
from r3lightning.rollout.explorers.base import ExplorationSpec
from r3lightning.rollout.explorers.in_context import InContextReflectionExplorer
from r3lightning.types import Trajectory, Turn


class History:
    """Task ``a`` is on a failure streak with a stored failed attempt; task ``b`` is not."""

    def recent_failures(self, task_id, count):
        return task_id == "a"

    def sample(self, task_id, want_success, k, rng):
        return [(Trajectory(task_id, [Turn([1], [5, 6], feedback="Incorrect, try again.")]), 0)]


class Loop:
    """Plays every request at once: in-context episodes of ``a`` succeed 3 times in 4, plain ones of ``a``
    once in 4, every episode of ``b`` succeeds (it must not enter the gate: it does not qualify)."""

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "7")

    def run(self, requests, sampling):
        out, seen = [], {}
        for r in requests:
            key = (r.task.task_id, r.origin)
            seen[key] = seen.get(key, 0) + 1
            if r.task.task_id == "b":
                success = True
            elif r.origin == "in_context":
                success = seen[key] <= 3
            else:
                success = seen[key] <= 1
            out.append(Trajectory(r.task.task_id, [Turn([1], [2])], reward=float(success), success=success, origin=r.origin))
        return out


def test_in_context_success_is_logged_beside_the_plain_success_of_the_same_tasks():
    explorer = InContextReflectionExplorer(share=0.5, after_failures=1)
    spec = ExplorationSpec(8, SamplingParams(max_new_tokens=4), history=History(), rng=random.Random(0))
    metrics = explorer.explore([Task("a", "1+1"), Task("b", "2+2")], Loop(), spec).metrics
    assert metrics["rollout/in_context_success_rate"] == pytest.approx(3 / 4)
    assert metrics["rollout/in_context_plain_success_rate"] == pytest.approx(1 / 4)
