"""Suites whose environments misbehave: one whose reward function never returns on odd tasks (the step
deadline), and ``FaultySuite``, whose reset or step raises, hangs or returns a malformed result
(importable because pytest's ``pythonpath`` includes ``tests/``)."""

import threading
import time

from r3lightning.envs.base import StepResult, Task, TaskSuite


class HangingEnv:
    """Rewards any answer with 1, except on odd tasks, where ``step`` never returns."""

    def reset(self, task):
        self.task = task
        return task.prompt

    def step(self, action):
        if self.task.data["index"] % 2:
            time.sleep(10**6)
        return StepResult("", 1.0, True, {"success": True})


class HangingSuite(TaskSuite):
    system_prompt, max_turns = "Answer.", 1

    def make_env(self):
        return HangingEnv()

    def train_task(self, index):
        return Task(f"hang#{index}", f"Question {index}?", data={"index": index})

    def val_tasks(self):
        return [self.train_task(0)]

    def demonstration(self, task):
        return None


class FaultyEnv:
    """Answers every task with reward 1, except that ``step`` (or ``reset``) has the fault it is given."""

    def __init__(self, fault, method, release):
        self.fault, self.method, self.release = fault, method, release

    def _misbehave(self, good):
        if self.fault == "raise":
            raise RuntimeError("simulator crashed")
        if self.fault == "hang":
            self.release.wait()
            return good
        return {"tuple": ("obs", 1.0, True, False, {}), "info_none": StepResult("obs", 1.0, True, None),
                "observation_none": StepResult(None, 1.0, True, {})}.get(self.fault, good)

    def reset(self, task):
        return self._misbehave(task.prompt) if self.method == "reset" else task.prompt

    def step(self, action):
        good = StepResult("well done", 1.0, True, {"success": True})
        return self._misbehave(good) if self.method == "step" else good


class FaultySuite(TaskSuite):
    """A one-turn suite with demonstrations whose environment's ``method`` (``step`` or ``reset``) has
    ``fault``: ``raise``, ``hang`` (until ``release`` is set), ``tuple`` (a gym-style result),
    ``info_none``, ``observation_none`` or ``none`` (no fault). ``max_turns`` is the suite's."""

    system_prompt = "Answer."

    def __init__(self, fault: str = "none", method: str = "step", max_turns=1):
        self.fault, self.method, self.max_turns = fault, method, max_turns
        self.release = threading.Event()

    def make_env(self):
        return FaultyEnv(self.fault, self.method, self.release)

    def train_task(self, index):
        return Task(f"faulty#{index}", f"Question {index}?", answer="4")

    def val_tasks(self):
        return [self.train_task(0)]

    def demonstration(self, task):
        return ["4"]
