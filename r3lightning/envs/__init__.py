"""Environments and verifiers. No model access here."""

from r3lightning.envs.base import Environment, StepResult, Task, TaskSuite

__all__ = ["Environment", "StepResult", "Task", "TaskSuite"]
