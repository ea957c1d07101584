"""Environments and verifiers. No model access here."""

from r3lightning.envs.base import AnswerFormat, Environment, StepResult, Task, TaskSuite
from r3lightning.envs.prompt_suite import PromptSuite

__all__ = ["AnswerFormat", "Environment", "PromptSuite", "StepResult", "Task", "TaskSuite"]
