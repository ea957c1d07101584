"""Reflect-GRPO exploration: reflect on each failed trajectory, retry it from scratch, distill the retry.

The baseline of the R³L paper (explorer ``reflect_from_scratch``). Per task:
``group_size // 2`` base trajectories; each failed one (reward below ``data.max_reward``) gets an R³L
reflection from the same policy (same prompt, parser and guidance as ``reflect_retry``); a valid
reflection triggers a retry in a fresh environment with the guidance shown from the first turn; the
retry with its guidance removed joins the group as a ``distilled`` trajectory. Unlike R³L there is no
pivot (nothing is replayed, so no prefix is shared and nothing is masked) and no meta-task SFT.
"""

from __future__ import annotations

import dataclasses

from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.explorers import Exploration, ExplorationSpec, ExplorerTraits
from r3lightning.rollout.reflect_retry import distill, retry_is_better
from r3lightning.rollout.reflection import Reflector, load_template
from r3lightning.types import Group, Trajectory


def distill_from_scratch(retry: Trajectory, origin: str) -> Trajectory:
    """A retry that started from scratch with its guidance removed (``distill``), as a trajectory of
    ``origin`` without pivot: it shares no prefix with any other trajectory, so pivotal credit has
    nothing to mask in it."""
    return dataclasses.replace(distill(retry, pivot=0), origin=origin, pivot=None)


def usable_retry(retry: Trajectory) -> bool:
    """A guided episode can join a group when its reward is sound and its guided first turn was
    played (a prompt that does not fit the context ends the episode before any turn)."""
    return not retry.reward_error and retry.guided_turn is not None


def failed(trajectory: Trajectory, max_reward: float) -> bool:
    """Below the maximum reward; a sample whose reward errored is not known to have failed."""
    return trajectory.reward < max_reward and not trajectory.reward_error


class ReflectFromScratchExplorer:
    """Reflect-GRPO's exploration (``reflect_from_scratch``): R³L's reflections, retries from scratch.

    The reflection's ``trajectory_outcome`` and ``retry_from_step`` are parsed and validated as in
    R³L (so invalid rates compare), but neither decides anything here: the reward already says the
    trajectory failed, and the retry always starts at the first turn.

    Args:
        reflection_temperature: sampling temperature of reflections.
        max_reflection_tokens: generation budget of one reflection.
        reflection_template: path of a reflection prompt template with ``{transcript}`` and
            ``{outcome}`` fields; empty for R³L's built-in one.
        guidance_template: path of a guidance template with the reflection's field names; empty for
            R³L's built-in one.
    """

    traits = ExplorerTraits(distilled_samples=True, reflects=True)

    def __init__(
        self,
        reflection_temperature: float = 1.0,
        max_reflection_tokens: int = 192,
        reflection_template: str = "",
        guidance_template: str = "",
    ) -> None:
        self.reflector = Reflector(
            reflection_temperature,
            max_reflection_tokens,
            load_template(reflection_template, "reflection.txt"),
            load_template(guidance_template, "guidance.txt"),
        )

    def tokenizer_corpus(self, suite) -> list[str]:
        """The reflector's templates, for a tokenizer trained in memory."""
        return [self.reflector.reflection_template, self.reflector.guidance_template]

    def explore(self, tasks: list[Task], loop: AgentLoop, spec: ExplorationSpec) -> Exploration:
        params, max_reward = spec.sampling, spec.max_reward
        n_base = max(1, spec.group_size // 2)
        base = loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(n_base)], params)
        reflected = [i for i, traj in enumerate(base) if failed(traj, max_reward)]
        parsed = self.reflector.reflect(loop, [base[i] for i in reflected], [tasks[i // n_base] for i in reflected], params).parsed
        valid = [(i, reflection) for i, (reflection, _) in zip(reflected, parsed) if reflection is not None]
        retry_of = [i for i, _ in valid]
        requests = [EpisodeRequest(task=tasks[i // n_base], guidance=self.reflector.guidance(r)) for i, r in valid]
        retries = loop.run(requests, params)
        distilled = {i: distill_from_scratch(r, "distilled") for i, r in zip(retry_of, retries) if usable_retry(r)}
        improved = sum(retry_is_better(base[i], r, max_reward) for i, r in zip(retry_of, retries) if i in distilled)
        groups = []
        for ti, task in enumerate(tasks):
            members = []
            for i in range(ti * n_base, (ti + 1) * n_base):
                members.append(base[i])
                if i in distilled:
                    members.append(distilled[i])
            groups.append(Group(task.task_id, members, task))
        counts = {
            "base": len(base),
            "reflections": len(parsed),
            "invalid": len(parsed) - len(retry_of),
            "retries": len(retries),
            "unusable": len(retries) - len(distilled),
            "improved": improved,
        }
        return Exploration(groups=groups, metrics=reflect_grpo_metrics(counts))


def reflect_grpo_metrics(counts: dict[str, int]) -> dict[str, float]:
    """Rates under R³L's tags where the figure means the same (reflections written only on failures,
    so the invalid rate is per reflection written); ``retry_unusable_rate`` counts retries that could
    not join the group (errored reward, or no turn played)."""
    return {
        "rollout/reflection_rate": counts["reflections"] / max(counts["base"], 1),
        "rollout/reflection_invalid_rate": counts["invalid"] / max(counts["reflections"], 1),
        "rollout/retry_rate": counts["retries"] / max(counts["base"], 1),
        "rollout/retry_unusable_rate": counts["unusable"] / max(counts["retries"], 1),
        "rollout/retry_improvement_rate": counts["improved"] / max(counts["retries"], 1),
    }
