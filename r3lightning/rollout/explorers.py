"""Explorers turn tasks into groups of trajectories. ``SampleExplorer`` is plain group sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.engine import SamplingParams
from r3lightning.types import Group, Trajectory


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
    def explore(self, tasks: list[Task], loop: AgentLoop, group_size: int, params: SamplingParams) -> Exploration:
        """Run episodes for ``tasks``; ``group_size`` is the rollout budget per task."""


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


class SampleExplorer:
    """``group_size`` independent episodes per task from the behaviour policy (GRPO and friends)."""

    def explore(self, tasks: list[Task], loop: AgentLoop, group_size: int, params: SamplingParams) -> Exploration:
        requests = [EpisodeRequest(task=task) for task in tasks for _ in range(group_size)]
        return Exploration(groups=groups_in_order(tasks, loop.run(requests, params), group_size))
