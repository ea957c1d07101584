"""Critique-GRPO exploration: critique each failed sample, refine from scratch, add the best refinement.

Zhang et al., arXiv 2506.03106 (explorer ``critique_refine``). Per task:
``group_size - num_refinements`` initial samples; the same policy writes a free-text critique of
each failed one from its transcript and the environment's feedback; a refinement episode then starts
from scratch with the previous attempt and its critique shown in the first turn. Refinements that do
not improve on their attempt are dropped (``rollout/refinement_dropped_rate``); the best
``num_refinements`` of the rest (highest reward, ties to the earlier one) join the group
with origin ``off_policy`` and the critique context removed, so the trainer scores their tokens under
the plain prompt and applies the policy-shaping loss ``-A · π/(π+γ)`` to them. Slots left without a
refinement are filled with plain samples, so every group has exactly ``group_size`` members.
"""

from __future__ import annotations

from typing import Optional

from r3lightning.engines.base import SamplingParams
from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.explorers.base import Exploration, ExplorationSpec, ExplorerTraits, GuidanceBudget
from r3lightning.rollout.explorers.reflect_from_scratch import distill_from_scratch, failed, usable_retry
from r3lightning.rollout.explorers.reflect_retry import retry_is_better
from r3lightning.rollout.explorers.reflection import ask_policy, load_template, outcome_text, step_lines, transcript
from r3lightning.types import Group, Trajectory


def best_refinements(candidates: list[Trajectory], count: int) -> list[Trajectory]:
    """The ``count`` highest-reward candidates, best first; equal rewards keep their order (the
    sort is stable), so a tie goes to the earlier refinement."""
    return sorted(candidates, key=lambda t: -t.reward)[:count]


class CritiqueRefineExplorer:
    """Critique-GRPO's exploration (``critique_refine``).

    Args:
        num_refinements: refinements kept per group (its off-policy samples); the group's other
            ``group_size - num_refinements`` members are initial samples. Must be below group_size.
        critique_temperature: sampling temperature of critiques.
        max_critique_tokens: generation budget of one critique.
        critique_template: path of a critique prompt template with ``{transcript}`` (the task, then
            each step's action and feedback) and ``{outcome}`` fields; empty for the built-in one.
        refinement_template: path of the template of what a refinement sees with its first
            observation, with ``{attempt}`` (the failed attempt's steps and feedback) and
            ``{critique}`` fields; empty for the built-in one.
    """

    traits = ExplorerTraits(off_policy_samples=True)

    def __init__(
        self,
        num_refinements: int = 1,
        critique_temperature: float = 1.0,
        max_critique_tokens: int = 192,
        critique_template: str = "",
        refinement_template: str = "",
    ) -> None:
        if num_refinements < 1:
            raise ValueError(f"CritiqueRefineExplorer: num_refinements must be >= 1, got {num_refinements}")
        self.num_refinements = num_refinements
        self.critique_temperature = critique_temperature
        self.max_critique_tokens = max_critique_tokens
        self.critique_template = load_template(critique_template, "critique.txt")
        self.refinement_template = load_template(refinement_template, "refinement.txt")

    # ---- prompts ------------------------------------------------------------------------------
    def critique_prompt(self, trajectory: Trajectory) -> str:
        return self.critique_template.format(transcript=transcript(trajectory), outcome=outcome_text(trajectory))

    def refinement_guidance(self, trajectory: Trajectory, critique: str) -> str:
        attempt = "\n".join(step_lines(trajectory)) or "(no steps)"
        return self.refinement_template.format(attempt=attempt, critique=critique).strip()

    def guidance_budget(self, sampling: SamplingParams, feedback: str) -> Optional[GuidanceBudget]:
        """The refinement template around a past answer (``max_new_tokens``) and a critique."""
        text = self.refinement_template.format(attempt="", critique="").strip()
        return GuidanceBudget(text, sampling.max_new_tokens + self.max_critique_tokens)

    # ---- exploration --------------------------------------------------------------------------
    def critique(self, loop: AgentLoop, trajectories: list[Trajectory], params: SamplingParams) -> list[str]:
        """The policy's critique of each trajectory (stripped text; empty when it wrote nothing), in
        one batched engine call at ``critique_temperature`` and the rollout's top-p."""
        critique_params = SamplingParams(
            temperature=self.critique_temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
            max_new_tokens=self.max_critique_tokens
        )
        _, generations = ask_policy(loop, [self.critique_prompt(t) for t in trajectories], critique_params)
        return [loop.tokenizer.decode(g.token_ids, skip_special_tokens=True).strip() for g in generations]

    def explore(self, tasks: list[Task], loop: AgentLoop, spec: ExplorationSpec) -> Exploration:
        group_size, params, max_reward = spec.group_size, spec.sampling, spec.max_reward
        if self.num_refinements >= group_size:
            raise ValueError(
                f"CritiqueRefineExplorer: num_refinements ({self.num_refinements}) must be below data.group_size ({group_size})"
            )
        n_initial = group_size - self.num_refinements
        initial = loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(n_initial)], params)
        critiqued = [i for i, traj in enumerate(initial) if failed(traj, max_reward)]
        critiques = self.critique(loop, [initial[i] for i in critiqued], params)
        refined = [(i, c) for i, c in zip(critiqued, critiques) if c]
        requests = [
            EpisodeRequest(task=tasks[i // n_initial], guidance=self.refinement_guidance(initial[i], c)) for i, c in refined
        ]
        refinements = loop.run(requests, params)
        usable = [(i, r) for (i, _), r in zip(refined, refinements) if usable_retry(r)]
        # Critique-GRPO keeps a refinement only when it improves on the attempt it refines.
        improving = [(i, r) for i, r in usable if r.reward > initial[i].reward]
        candidates: list[list[Trajectory]] = [[] for _ in tasks]
        for i, refinement in improving:
            candidates[i // n_initial].append(refinement)
        chosen = [
            [distill_from_scratch(r, "off_policy") for r in best_refinements(c, self.num_refinements)] for c in candidates
        ]
        fill_tasks = [task for task, kept in zip(tasks, chosen) for _ in range(self.num_refinements - len(kept))]
        fills = iter(loop.run([EpisodeRequest(task=t) for t in fill_tasks], params))
        groups = []
        for ti, task in enumerate(tasks):
            members = initial[ti * n_initial : (ti + 1) * n_initial] + chosen[ti]
            members += [next(fills) for _ in range(self.num_refinements - len(chosen[ti]))]
            groups.append(Group(task.task_id, members, task))
        counts = {
            "initial": len(initial),
            "critiques": len(critiques),
            "empty": len(critiques) - len(refined),
            "refinements": len(refinements),
            "unusable": len(refinements) - len(usable),
            "not_improving": len(usable) - len(improving),
            "improved": sum(retry_is_better(initial[i], r, max_reward) for i, r in usable),
            "slots": len(tasks) * self.num_refinements,
            "filled": len(fill_tasks),
        }
        return Exploration(groups=groups, metrics=critique_grpo_metrics(counts))


def critique_grpo_metrics(counts: dict[str, int]) -> dict[str, float]:
    """``critique_empty_rate`` and ``refinement_unusable_rate`` count fallbacks (no refinement for an
    empty critique; a refinement with an errored reward or no turn played is not used);
    ``refinement_fill_rate`` is the share of refinement slots given to plain samples instead."""
    return {
        "rollout/critique_rate": counts["critiques"] / max(counts["initial"], 1),
        "rollout/critique_empty_rate": counts["empty"] / max(counts["critiques"], 1),
        "rollout/refinement_unusable_rate": counts["unusable"] / max(counts["refinements"], 1),
        "rollout/refinement_improvement_rate": counts["improved"] / max(counts["refinements"], 1),
        "rollout/refinement_dropped_rate": counts["not_improving"] / max(counts["refinements"], 1),
        "rollout/refinement_fill_rate": counts["filled"] / max(counts["slots"], 1),
    }
