"""A one-turn suite whose reward function never returns on odd tasks, for the step deadline
(importable because pytest's ``pythonpath`` includes ``tests/``)."""

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
