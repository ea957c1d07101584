"""Explorers turn tasks into groups of trajectories. ``SampleExplorer`` is plain group sampling."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Protocol

from r3lightning.engines.base import SamplingParams
from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.types import Group, Trajectory


class AttemptHistory(Protocol):
    """Past attempts per task (the datamodule's replay buffer, ``r3lightning.data.replay``)."""

    def recent_failures(self, task_id: str, m: int) -> bool:
        """Whether the task's last ``m`` visits all failed."""

    def sample(self, task_id: str, want_success: bool, k: int, rng: random.Random) -> list[tuple[Trajectory, int]]:
        """Up to ``k`` stored trajectories of the task with that outcome, with the step they were stored at."""


@dataclass
class ExplorationSpec:
    """What every explorer is asked for, the same for all of them.

    group_size: rollout budget per task (N in the papers).
    sampling: sampling parameters of the episodes.
    max_reward: the reward of a full success (``data.max_reward``): at or above it a sample is solved
        (no reflection or critique, the meta-task rule).
    history: past attempts per task, for explorers whose traits say ``uses_history``.
    rng: the step's random stream for choices an explorer makes outside the engine (seeded per step).
    """

    group_size: int
    sampling: SamplingParams
    max_reward: float = 1.0
    history: Optional[AttemptHistory] = None
    rng: random.Random = field(default_factory=lambda: random.Random(0))


@dataclass(frozen=True)
class ExplorerTraits:
    """What an explorer's output can contain; the datamodule checks objective knobs against it, so a
    knob that would silently do nothing is refused (docs/configuration.md, "Valid combinations").

    sets_pivots: some trajectories carry a pivot (pivotal credit has something to mask).
    sft_samples: it hands samples to the SFT head during RL (meta-tasks).
    off_policy_samples: some trajectories have origin ``off_policy`` (Critique-GRPO's shaping loss).
    distilled_samples: some trajectories were sampled under guidance and are trained without it, so
        their behaviour log-probs belong to another context.
    reflects: it writes R³L reflections (the scripted reflection warm-start needs its templates).
    uses_history: it reads past attempts (``ExplorationSpec.history``), so the datamodule keeps them.
    """

    sets_pivots: bool = False
    sft_samples: bool = False
    off_policy_samples: bool = False
    distilled_samples: bool = False
    reflects: bool = False
    uses_history: bool = False


@dataclass(frozen=True)
class GuidanceBudget:
    """The most an explorer adds to a task's prompt, for the setup check that its prompts fit the context.

    text: the guidance as shown with the generated parts (past answer, reflection, critique) left empty.
    generated_tokens: the most tokens those parts can add (their generation budgets).
    """

    text: str
    generated_tokens: int


@dataclass
class Exploration:
    """What one exploration step produced.

    groups: RL groups (one per task), normalized together by the advantage estimator.
    sft: trajectories for the SFT head (R³L meta-tasks, GNT reflections...).
    metrics: explorer-specific figures under ``rollout/...`` tags.
    """

    groups: list[Group]
    sft: list[Trajectory] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


class Explorer(Protocol):
    @property
    def traits(self) -> ExplorerTraits:
        """What this explorer's output can contain."""

    def explore(self, tasks: list[Task], loop: AgentLoop, spec: ExplorationSpec) -> Exploration:
        """Run episodes for ``tasks`` within ``spec.group_size`` episodes per task."""

    def guidance_budget(self, sampling: SamplingParams, feedback: str) -> Optional[GuidanceBudget]:
        """What this explorer adds to a task's first prompt at most (None: nothing). ``feedback`` is the
        longest feedback the suite writes after a failed answer (``TaskSuite.feedback_texts``), for
        explorers that show a past attempt with its feedback."""


def groups_in_order(tasks: list[Task], trajectories: list[Trajectory], group_size: int) -> list[Group]:
    """Split task-major trajectories (``group_size`` per task, in task order) into groups.

    By position, not by task id: a finite dataset that wraps around may put one task twice in a batch,
    and those are two groups.
    """
    if len(trajectories) != len(tasks) * group_size:
        raise ValueError(f"{len(trajectories)} trajectories for {len(tasks)} tasks x group_size {group_size}")
    return [
        Group(task_id=task.task_id, trajectories=trajectories[i * group_size : (i + 1) * group_size], task=task)
        for i, task in enumerate(tasks)
    ]


def sample_groups(tasks: list[Task], loop: AgentLoop, spec: ExplorationSpec) -> list[Group]:
    """``spec.group_size`` independent episodes per task, in one ``loop.run``."""
    requests = [EpisodeRequest(task=task) for task in tasks for _ in range(spec.group_size)]
    return groups_in_order(tasks, loop.run(requests, spec.sampling), spec.group_size)


class SampleExplorer:
    """``group_size`` independent episodes per task from the behaviour policy (GRPO and friends)."""

    traits = ExplorerTraits()

    def explore(self, tasks: list[Task], loop: AgentLoop, spec: ExplorationSpec) -> Exploration:
        return Exploration(groups=sample_groups(tasks, loop, spec))

    def guidance_budget(self, sampling: SamplingParams, feedback: str) -> Optional[GuidanceBudget]:
        return None
