"""The environment protocol every task speaks (docs/environments.md).

``reset(task) -> observation`` and ``step(action) -> StepResult``. ``StepResult.info["feedback"]``
carries the natural-language feedback that reflection reads; ``info["admissible_actions"]`` lists
valid actions when the environment has them. Environments never touch a model.

A ``TaskSuite`` bundles a task source with an environment maker; it is what configs name under
``data.suite``. A task is a plain ``Task``: an id, a prompt-ready payload and the data its verifier needs, so the
same task can be replayed (R³L retry, R³ replay) by resetting a fresh environment with it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Protocol, runtime_checkable

AnswerFormat = Literal["tag", "line", "raw"]
"""How a response becomes an action: the text inside an ``<action>`` tag, its first non-empty line, or
the whole response (``r3lightning.rollout.agent_loop.parse_action``)."""


@dataclass
class Task:
    """One task instance.

    task_id: stable id (replay buffers and groups are keyed by it).
    prompt: the initial user message (for single-turn tasks, the question).
    answer: reference answer for verifiers (None for interactive worlds).
    data: anything else the environment needs to rebuild the episode (seed, game file, ...).
    history: chat messages (``{"role", "content"}``) that come before ``prompt`` in the conversation: a
        system message (which then replaces the suite's ``system_prompt``) and earlier turns; None: the
        suite's system prompt, then ``prompt``.
    """

    task_id: str
    prompt: str
    answer: Optional[str] = None
    data: dict[str, Any] = field(default_factory=dict)
    history: Optional[list[dict[str, str]]] = None


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def feedback(self) -> str:
        return str(self.info.get("feedback", ""))


@runtime_checkable
class Environment(Protocol):
    """One episode at a time; create one instance per concurrent episode via ``TaskSuite.make_env``.

    ``StepResult.info`` keys the framework reads: ``feedback`` (str), ``success`` (bool, on the final
    step), ``admissible_actions`` (list[str], optional), ``invalid_action`` (bool, optional),
    ``reward_error`` (bool: the verifier raised or timed out; the sample is masked and counted) and
    ``partial_credit`` (float in [0, 1], optional, on the final step: how close a failed answer came;
    read only by R³'s premise gate, ``Trajectory.partial_credit``).
    """

    def reset(self, task: Task) -> str:
        """Start ``task``; return the first observation (the user message)."""

    def step(self, action: str) -> StepResult:
        """Apply ``action``; reward is the episode reward so far in [0, 1] on the final step."""


class TaskSuite(abc.ABC):
    """What the data layer configures: a task source plus a way to make environments.

    Subclass it and name the subclass in ``data.suite.class_path``. Subclasses set ``system_prompt``
    (the system message of each conversation), ``max_turns`` (the episode step limit) and, when their
    environment reads responses in one way only, ``answer_format``.
    """

    system_prompt: str = ""
    max_turns: int = 1
    answer_format: Optional[AnswerFormat] = None
    """The response format the environment reads (``raw`` for a verifier that finds the answer in the
    whole response), or None when it reads any (it parses actions itself). ``data.agent.action_format``
    must agree: unset, it takes this value; set to another, the datamodule refuses to start."""

    @abc.abstractmethod
    def make_env(self) -> Environment:
        """A fresh environment instance."""

    @abc.abstractmethod
    def train_task(self, index: int) -> Task:
        """Training task number ``index`` (any int >= 0), a pure function of the suite's config.

        Random access makes the data cursor a single integer (exact resume) and lets ranks shard the
        stream by index. Finite datasets wrap around with a per-epoch shuffle.
        """

    @abc.abstractmethod
    def val_tasks(self) -> list[Task]:
        """The fixed held-out tasks used for validation."""

    @abc.abstractmethod
    def demonstration(self, task: Task) -> Optional[list[str]]:
        """Expert actions (one per turn) for SFT warm-start, or None when there is no expert."""

    def feedback_texts(self) -> tuple[str, ...]:
        """Every feedback text the environment writes after an answer that does not end the episode in
        success (default: none declared). The in-context setup check budgets the longest of them for the
        past attempt's feedback; without any it budgets ``(no feedback)``."""
        return ()

    def diagnose(self, task: Task, actions: list[str], feedbacks: Optional[list[str]] = None) -> Optional[dict[str, Any]]:
        """A scripted reflection in the R³L JSON format for a played trajectory, or None (default)
        when the suite has no diagnostician. Used for reflective SFT warm-start data."""
        return None

    def expert_continuation(self, task: Task, prefix_actions: list[str]) -> Optional[list[str]]:
        """Expert actions that finish ``task`` after ``prefix_actions``, or None (default)."""
        return None

    def describe(self) -> str:
        """How errors name the suite and the user code its environments call (default: the class name)."""
        return type(self).__name__
