"""Environments and verifiers. No model access here."""

from r3lightning.envs.base import AnswerFormat, Environment, StepResult, Task, TaskSuite

__all__ = ["AnswerFormat", "Environment", "StepResult", "Task", "TaskSuite"]
