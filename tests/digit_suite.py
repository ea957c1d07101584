"""A one-turn suite that rewards any response with a digit: a random tiny policy gets mixed rewards, so
every RL step has a learning signal (arithmetic gives all-zero rewards before much training)."""

from r3lightning.envs.base import StepResult, Task, TaskSuite


class DigitEnv:
    def reset(self, task):
        return task.prompt

    def step(self, action):
        success = any(c.isdigit() for c in action)
        return StepResult("", float(success), True, {"feedback": "", "success": success})


class DigitSuite(TaskSuite):
    system_prompt, max_turns = "Answer with a number.", 1

    def make_env(self):
        return DigitEnv()

    def train_task(self, index):
        return Task(f"digit#{index}", f"Say a number above {index % 7}.", answer=str(index % 7 + 1))

    def val_tasks(self):
        return [self.train_task(0)]

    def demonstration(self, task):
        return [task.answer]
