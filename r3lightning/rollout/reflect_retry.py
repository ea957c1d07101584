"""R³L exploration: reflect on each base trajectory, retry from its pivot, distill the retry.

Per task (DESIGN.md §5): ``group_size // 2`` base trajectories; the same policy writes a structured
JSON reflection of each; a valid, non-``success`` reflection triggers a retry from
``retry_from_step`` k (fresh environment, first k actions replayed with their original tokens,
guidance shown with the pivot observation only); the retry's guidance is then removed (context
distillation) and the distilled trajectory joins the base ones in the group. Both members of a
base/distilled pair carry the pivot, so pivotal credit masks their shared prefix. When the retry
improves on the base, a reflect sample and a retry sample are added for the SFT head.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from importlib import resources
from typing import Any, Optional

from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.rollout.engine import SamplingParams
from r3lightning.rollout.explorers import Exploration
from r3lightning.types import Group, Trajectory, Turn

OUTCOMES = ("success", "success_but_inefficient", "failure")
REFLECTION_FIELDS = ("trajectory_summary", "root_cause_analysis", "trajectory_outcome", "improvement_suggestion", "retry_from_step")


def _template(name: str) -> str:
    return resources.files("r3lightning").joinpath("templates", name).read_text()


@dataclass
class Reflection:
    """A validated reflection. ``retry_from_step`` is within [0, number of turns - 1]."""

    trajectory_summary: str
    root_cause_analysis: str
    trajectory_outcome: str
    improvement_suggestion: str
    retry_from_step: int

    def as_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def parse_reflection(text: str, num_turns: int) -> tuple[Optional[Reflection], str]:
    """Parse a reflection robustly: (reflection, "") or (None, reason). Never raises.

    The JSON object is taken from the first ``{`` to the last ``}``; ``retry_from_step`` is coerced
    to int (``"2"``, ``2.0``) and must lie in [0, num_turns - 1]; the outcome must be one of
    ``success``, ``success_but_inefficient``, ``failure``; text fields must be strings.
    """
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None, "no_json"
    try:
        raw = json.loads(text[start : end + 1])
    except (ValueError, RecursionError):
        return None, "bad_json"
    if any(name not in raw for name in REFLECTION_FIELDS):
        return None, "missing_field"
    if any(not isinstance(raw[name], str) for name in REFLECTION_FIELDS[:4]):
        return None, "wrong_type"
    if raw["trajectory_outcome"] not in OUTCOMES:
        return None, "bad_outcome"
    step = raw["retry_from_step"]
    if isinstance(step, bool):
        return None, "wrong_type"
    try:
        as_float = float(step)
    except (TypeError, ValueError, OverflowError):
        return None, "wrong_type"
    if as_float != as_float or as_float in (float("inf"), float("-inf")) or as_float != int(as_float):
        return None, "wrong_type"
    step = int(as_float)
    if not 0 <= step < max(num_turns, 1):
        return None, "step_out_of_range"
    return Reflection(*(raw[name] for name in REFLECTION_FIELDS[:4]), retry_from_step=step), ""


def transcript(trajectory: Trajectory) -> str:
    """The trajectory as the reflection prompt shows it: the first observation (it states the task),
    then one line per step with the action and the environment's feedback. Later observations are
    left out to keep the prompt short; the feedback carries what reflection needs."""
    if not trajectory.turns:
        return "(no steps)"
    lines = [trajectory.turns[0].observation]
    for i, turn in enumerate(trajectory.turns):
        lines.append(f"Step {i}: {turn.action or '(no valid action)'} -> {turn.feedback or '(no feedback)'}")
    return "\n".join(lines)


def outcome_text(trajectory: Trajectory) -> str:
    state = "succeeded" if trajectory.success else "failed"
    return f"{state} after {len(trajectory.turns)} steps with reward {trajectory.reward:g}"


def distill(retry: Trajectory, pivot: int) -> Trajectory:
    """The retry with its guidance removed: the pivot turn gets the context it would have had
    without guidance; every generated token is kept as generated."""
    if "unguided_context" not in retry.info:
        raise ValueError(f"retry of task {retry.task_id!r} has no guided turn to distill (it ended before turn {pivot})")
    turn_index, unguided = retry.info["unguided_context"]
    turns = list(retry.turns)
    turns[turn_index] = dataclasses.replace(turns[turn_index], context_ids=list(unguided))
    info = {k: v for k, v in retry.info.items() if k != "unguided_context"}
    return dataclasses.replace(retry, turns=turns, origin="distilled", pivot=pivot, info=info)


def retry_is_better(base: Trajectory, retry: Trajectory, max_reward: float) -> bool:
    """DESIGN §5: the retry beats the base and reaches the maximum, or both succeed and it is shorter."""
    if retry.reward > base.reward and retry.reward >= max_reward:
        return True
    return retry.success and base.success and len(retry.turns) < len(base.turns)


class ReflectRetryExplorer:
    """R³L's language-guided exploration (``reflect_retry``).

    Args:
        retry: reflect and retry; false gives the ``r3l_wo_reflect`` ablation (all ``group_size``
            trajectories are plain samples, nothing else changes).
        reflection_temperature: sampling temperature of reflections.
        max_reflection_tokens: generation budget of one reflection.
        meta_tasks: add reflect and retry SFT samples when a retry improves on its base.
        max_reward: reward that counts as the maximum (meta-task rule).
        reflection_template: path of a reflection prompt template with ``{transcript}`` and
            ``{outcome}`` fields; empty for the built-in one.
        guidance_template: path of a guidance template with the reflection's field names; empty for
            the built-in one.
    """

    def __init__(
        self,
        retry: bool = True,
        reflection_temperature: float = 1.0,
        max_reflection_tokens: int = 192,
        meta_tasks: bool = True,
        max_reward: float = 1.0,
        reflection_template: str = "",
        guidance_template: str = "",
    ) -> None:
        self.retry = retry
        self.reflection_temperature = reflection_temperature
        self.max_reflection_tokens = max_reflection_tokens
        self.meta_tasks = meta_tasks
        self.max_reward = max_reward
        self.reflection_template = open(reflection_template).read() if reflection_template else _template("reflection.txt")
        self.guidance_template = open(guidance_template).read() if guidance_template else _template("guidance.txt")

    # ---- prompts ------------------------------------------------------------------------------
    def reflection_prompt(self, trajectory: Trajectory) -> str:
        return self.reflection_template.format(transcript=transcript(trajectory), outcome=outcome_text(trajectory))

    def guidance(self, reflection: Reflection | dict[str, Any]) -> str:
        fields = dataclasses.asdict(reflection) if isinstance(reflection, Reflection) else reflection
        return self.guidance_template.format(**fields).strip()

    def tokenizer_corpus(self, suite, num_tasks: int = 64) -> list[str]:
        """Texts of this explorer's prompts and, when the suite has a diagnostician, example
        reflections, so a tokenizer trained in memory encodes reflections compactly."""
        texts = [self.reflection_template, self.guidance_template]
        for index in range(num_tasks):
            task = suite.train_task(index)
            plan = suite.demonstration(task) or []
            diagnosis = suite.diagnose(task, ["look", *plan])
            if diagnosis is None:
                break
            texts.extend([json.dumps(diagnosis), self.guidance(diagnosis)])
        return texts

    # ---- exploration --------------------------------------------------------------------------
    def explore(self, tasks: list[Task], loop: AgentLoop, group_size: int, params: SamplingParams) -> Exploration:
        if not self.retry:
            requests = [EpisodeRequest(task=t) for t in tasks for _ in range(group_size)]
            runs = loop.run(requests, params)
            groups = [Group(t.task_id, runs[i * group_size : (i + 1) * group_size], t) for i, t in enumerate(tasks)]
            return Exploration(groups=groups)
        n_base = max(1, group_size // 2)
        base = loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(n_base)], params)
        chat = ChatFormatter(loop.tokenizer, system_prompt=None)
        prompts = [chat.first_prompt(self.reflection_prompt(t)) for t in base]
        reflect_params = SamplingParams(
            temperature=self.reflection_temperature, top_p=params.top_p, max_new_tokens=self.max_reflection_tokens
        )
        generations = loop.engine.generate(prompts, reflect_params)
        parsed = [
            parse_reflection(loop.tokenizer.decode(g.token_ids, skip_special_tokens=True), len(t.turns))
            for g, t in zip(generations, base)
        ]
        retry_of: list[int] = []
        requests = []
        for i, (traj, (reflection, _)) in enumerate(zip(base, parsed)):
            if reflection is None or reflection.trajectory_outcome == "success" or traj.reward_error:
                continue
            k = reflection.retry_from_step
            task = tasks[i // n_base]
            retry_of.append(i)
            requests.append(
                EpisodeRequest(task=task, prefix=traj.turns[:k], guidance=self.guidance(reflection), info={"pivot": k})
            )
        retries = loop.run(requests, params) if requests else []
        distilled_by_base: dict[int, Trajectory] = {}
        sft: list[Trajectory] = []
        improved = 0
        for i, retry in zip(retry_of, retries):
            k = retry.info["pivot"]
            if retry.reward_error or "unguided_context" not in retry.info:
                continue
            distilled_by_base[i] = distill(retry, k)
            if k > 0:
                base[i] = dataclasses.replace(base[i], pivot=k)
            if retry_is_better(base[i], retry, self.max_reward):
                improved += 1
                if self.meta_tasks:
                    sft.extend(self.meta_task_samples(base[i], prompts[i], generations[i].token_ids, retry, k))
        groups = []
        for ti, task in enumerate(tasks):
            members = []
            for i in range(ti * n_base, (ti + 1) * n_base):
                members.append(base[i])
                if i in distilled_by_base:
                    members.append(distilled_by_base[i])
            groups.append(Group(task.task_id, members, task))
        metrics = self.metrics(base, parsed, retry_of, retries, improved)
        return Exploration(groups=groups, sft=sft, metrics=metrics)

    def meta_task_samples(
        self, base: Trajectory, reflect_prompt: list[int], reflection_ids: list[int], retry: Trajectory, pivot: int
    ) -> list[Trajectory]:
        """Reflect sample ([trajectory, feedback] -> reflection) and retry sample (prefix + guidance ->
        corrected suffix; the replayed prefix is context only)."""
        reflect = Trajectory(
            task_id=base.task_id,
            turns=[Turn(context_ids=list(reflect_prompt), response_ids=list(reflection_ids))],
            reward=retry.reward,
            success=True,
            origin="reflect_sft",
        )
        turns = [dataclasses.replace(t, trainable=False) for t in retry.turns[:pivot]] + list(retry.turns[pivot:])
        retry_sample = dataclasses.replace(retry, turns=turns, origin="retry_sft", pivot=None, info={})
        return [reflect, retry_sample]

    @staticmethod
    def metrics(base, parsed, retry_of, retries, improved) -> dict[str, float]:
        invalid = sum(1 for reflection, _ in parsed if reflection is None)
        positions = [retry.info["pivot"] / max(len(base[i].turns), 1) for i, retry in zip(retry_of, retries)]
        saved = sum(sum(len(t.response_ids) for t in base[i].turns[: r.info["pivot"]]) for i, r in zip(retry_of, retries))
        return {
            "rollout/reflection_invalid_rate": invalid / max(len(parsed), 1),
            "rollout/retry_rate": len(retries) / max(len(base), 1),
            "rollout/retry_improvement_rate": improved / max(len(retries), 1),
            "rollout/pivot_position": sum(positions) / len(positions) if positions else 0.0,
            "rollout/retry_tokens_saved": float(saved),
        }


def scripted_reflection_samples(
    loop: AgentLoop, explorer: ReflectRetryExplorer, tasks: list[Task], rng: random.Random
) -> list[Trajectory]:
    """Warm-start SFT data from a suite's scripted diagnostician (procedural worlds have one).

    For each task: the expert plan with one injected mistake (a random admissible action at a random
    step), continued with random admissible actions; the diagnostician's reflection of it (reflect
    sample), and the expert's continuation from the pivot under the guidance (retry sample).
    """
    suite = loop.suite
    samples: list[Trajectory] = []
    flawed_actions = []
    for task in tasks:
        plan = suite.demonstration(task) or []
        step = rng.randrange(max(len(plan), 1))
        actions = plan[:step] + [_wrong_action(suite, task, plan[:step], plan[step] if step < len(plan) else None, rng)]
        flawed_actions.append(actions)
    flawed = loop.play_actions([EpisodeRequest(task=t) for t in tasks], flawed_actions, allow_unfinished=True)
    chat = ChatFormatter(loop.tokenizer, system_prompt=None)
    retry_requests, retry_actions = [], []
    for task, traj in zip(tasks, flawed):
        diagnosis = suite.diagnose(task, traj.actions, [t.feedback for t in traj.turns])
        if diagnosis is None:
            continue
        k = min(int(diagnosis["retry_from_step"]), len(traj.turns) - 1)
        diagnosis = {**diagnosis, "retry_from_step": k}
        prompt = chat.first_prompt(explorer.reflection_prompt(traj))
        answer = loop.tokenizer(json.dumps(diagnosis), add_special_tokens=False)["input_ids"] + [loop.tokenizer.eos_token_id]
        samples.append(Trajectory(task.task_id, [Turn(context_ids=prompt, response_ids=answer)], 1.0, True, origin="reflect_sft"))
        continuation = suite.expert_continuation(task, traj.actions[:k])
        if diagnosis["trajectory_outcome"] != "success" and continuation:
            retry_requests.append(EpisodeRequest(task=task, prefix=traj.turns[:k], guidance=explorer.guidance(diagnosis)))
            retry_actions.append(continuation)
    if not retry_requests:
        return samples
    retries = loop.play_actions(retry_requests, retry_actions)
    for request, traj in zip(retry_requests, retries):
        k = len(request.prefix)
        turns = [dataclasses.replace(t, trainable=False) for t in traj.turns[:k]] + list(traj.turns[k:])
        samples.append(dataclasses.replace(traj, turns=turns, origin="retry_sft", info={}))
    return samples


def _wrong_action(suite, task: Task, prefix: list[str], correct: Optional[str], rng: random.Random) -> str:
    env = suite.make_env()
    env.reset(task)
    result = None
    for action in prefix:
        result = env.step(action)
    admissible = list(result.info.get("admissible_actions", [])) if result is not None else []
    if not admissible:
        probe = suite.make_env()
        probe.reset(task)
        admissible = list(probe.step("look").info.get("admissible_actions", []))
    choices = [a for a in admissible if a != correct] or ["look"]
    return rng.choice(choices)
