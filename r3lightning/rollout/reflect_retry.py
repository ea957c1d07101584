"""R³L exploration: reflect on each base trajectory, retry from its pivot, distill the retry.

Per task (DESIGN.md §5): ``group_size // 2`` base trajectories; the same policy writes a structured
JSON reflection of each; a valid, non-``success`` reflection triggers a retry from
``retry_from_step`` k (fresh environment, first k actions replayed with their original tokens,
guidance shown with the pivot observation only); the retry's guidance is then removed (context
distillation) and the distilled trajectory joins the base ones in the group. Both members of a
base/distilled pair carry the pivot, so pivotal credit masks their shared prefix. When the retry
improves on the base, a reflect sample and a retry sample are added for the SFT head.

Single-turn reasoning (``step_split: auto`` and a suite with ``max_turns == 1``) pivots on steps
instead of turns: the response is split into steps (``rollout.steps``), the reflection sees them
numbered, and the retry continues the same assistant message from the first k steps' tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, Optional

from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.rollout.engine import Generation, SamplingParams
from r3lightning.rollout.explorers import Exploration
from r3lightning.rollout.steps import split_final_turn
from r3lightning.types import Group, Trajectory, Turn

OUTCOMES = ("success", "success_but_inefficient", "failure")
REFLECTION_FIELDS = ("trajectory_summary", "root_cause_analysis", "trajectory_outcome", "improvement_suggestion", "retry_from_step")


def load_template(path: str, builtin: str) -> str:
    """The prompt template at ``path``, or the package's ``templates/<builtin>`` when ``path`` is empty."""
    if path:
        with open(path) as handle:
            return handle.read()
    return resources.files("r3lightning").joinpath("templates", builtin).read_text()


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
    return "\n".join([trajectory.turns[0].observation, *step_lines(trajectory)])


def step_lines(trajectory: Trajectory) -> list[str]:
    """One line per step: its action and the environment's feedback."""
    return [
        f"Step {i}: {turn.action or '(no valid action)'} -> {turn.feedback or '(no feedback)'}"
        for i, turn in enumerate(trajectory.turns)
    ]


def step_transcript(trajectory: Trajectory, tokenizer) -> str:
    """A step-level trajectory (one reasoning message split into step turns) as the reflection prompt
    shows it: the question, each step's text numbered ``Step i:``, then the environment's feedback."""
    if not trajectory.turns:
        return "(no steps)"
    lines = [trajectory.turns[0].observation]
    for i, turn in enumerate(trajectory.turns):
        text = tokenizer.decode(turn.response_ids, skip_special_tokens=True).strip()
        lines.append(f"Step {i}: {text or '(empty)'}")
    lines.append(f"Feedback: {trajectory.turns[-1].feedback or '(no feedback)'}")
    return "\n".join(lines)


def ask_policy(loop: AgentLoop, messages: list[str], params: SamplingParams) -> tuple[list[list[int]], list[Generation]]:
    """Each message as the only user turn of a fresh conversation without system prompt, answered in
    one batched engine call: (prompt tokens, generations). Reflections and critiques are asked this
    way, outside any episode."""
    prompts = standalone_prompts(loop, messages)
    return prompts, (loop.engine.generate(prompts, params) if prompts else [])


def standalone_prompts(loop: AgentLoop, messages: list[str]) -> list[list[int]]:
    """Each message as the only user turn of a fresh conversation without system prompt, as tokens."""
    chat = ChatFormatter(loop.tokenizer, system_prompt=None)
    return [chat.first_prompt(message) for message in messages]


def target_tokens(tokenizer, texts: list[str]) -> list[list[int]]:
    """Texts written for the policy (scripted reflections) as its answers: tokens, then end of turn."""
    if not texts:
        return []
    eos = tokenizer.eos_token_id
    return [ids + [eos] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


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
        retry_below_max_reward_only: retry only trajectories whose reward is below ``max_reward``,
            whatever their reflection's outcome says. The paper trusts the reflection (``success`` →
            no retry); a small policy's self-assessment is unreliable
            (``rollout/reflection_outcome_agreement``), and the retry of a trajectory that already
            has the maximum reward can at best tie it, so that half of the budget is better spent on
            failures. This also skips the retries of inefficient successes.
        refill_groups: where a base trajectory got no retry (its reflection was invalid or said
            ``success``, the gate above skipped it, or the retry failed to run), sample a fresh
            trajectory of the task instead, so every group keeps ``group_size`` members and the
            rollout budget stays that of GRPO. Off in the paper, whose groups shrink. The fresh
            samples are plain base trajectories (no reflection); ``rollout/refill_rate`` is their
            share of the group slots.
        reflector: who writes the reflections. ``policy`` (the paper): the policy itself, in one
            batched generation. ``suite``: the suite's scripted diagnostician (``TaskSuite.diagnose``),
            which knows the optimal plan: a privileged reflector that isolates the retry mechanism
            (pivot, guidance, distillation, pivotal credit) from the quality of the policy's own
            reflections, the stand-in for a stronger reflector model at CPU scale. With
            ``meta_tasks``, the reflect samples then teach the policy the diagnostician's reflections
            on its own episodes. Needs a suite with a diagnostician (the procedural world).
        step_split: ``auto``: when the suite plays one turn per episode (``max_turns == 1``, single-turn
            reasoning), pivot on reasoning steps — responses are split into lines
            (``rollout.steps.step_lengths``) and the retry continues the message from the first k
            steps; otherwise pivot on turns. ``off``: always turns (a single-turn retry restarts
            from scratch).
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
        step_split: Literal["auto", "off"] = "auto",
        retry_below_max_reward_only: bool = False,
        refill_groups: bool = False,
        reflector: Literal["policy", "suite"] = "policy",
    ) -> None:
        if step_split not in ("auto", "off"):
            raise ValueError(f"step_split must be 'auto' or 'off', got {step_split!r}")
        if reflector not in ("policy", "suite"):
            raise ValueError(f"reflector must be 'policy' or 'suite', got {reflector!r}")
        self.retry = retry
        self.reflection_temperature = reflection_temperature
        self.max_reflection_tokens = max_reflection_tokens
        self.meta_tasks = meta_tasks
        self.max_reward = max_reward
        self.reflection_template = load_template(reflection_template, "reflection.txt")
        self.guidance_template = load_template(guidance_template, "guidance.txt")
        self.step_split = step_split
        self.retry_below_max_reward_only = retry_below_max_reward_only
        self.refill_groups = refill_groups
        self.reflector = reflector

    # ---- prompts ------------------------------------------------------------------------------
    def reflection_prompt(self, trajectory: Trajectory, tokenizer=None) -> str:
        """The reflection request; with ``tokenizer``, ``trajectory`` is step-level and its steps are
        shown decoded (``step_transcript``)."""
        shown = transcript(trajectory) if tokenizer is None else step_transcript(trajectory, tokenizer)
        return self.reflection_template.format(transcript=shown, outcome=outcome_text(trajectory))

    def step_level(self, loop: AgentLoop) -> bool:
        """Whether pivots are reasoning steps (see ``step_split``)."""
        return self.step_split == "auto" and loop.suite.max_turns == 1

    def guidance(self, reflection: Reflection | dict[str, Any]) -> str:
        fields = dataclasses.asdict(reflection) if isinstance(reflection, Reflection) else reflection
        return self.guidance_template.format(**fields).strip()

    def tokenizer_corpus(self, suite, num_tasks: int = 64) -> list[str]:
        """Texts of this explorer's prompts and, when the suite has a diagnostician, example
        reflections, so a tokenizer trained in memory encodes reflections compactly."""
        texts = [self.reflection_template, self.guidance_template]
        rng = random.Random(0)
        for index in range(num_tasks):
            task = suite.train_task(index)
            plan = suite.demonstration(task) or []
            # An inefficient success, then a failure with a mistake at a random step: the failure
            # wording ("failed", the root causes) must be in the vocabulary as much as the success's.
            step = rng.randrange(max(len(plan), 1))
            flawed = plan[:step] + [_wrong_action(suite, task, plan[:step], plan[step] if step < len(plan) else None, rng)]
            for actions in (["look", *plan], flawed):
                diagnosis = suite.diagnose(task, actions)
                if diagnosis is None:
                    return texts
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
        step_level = self.step_level(loop)
        if step_level:
            base = [split_final_turn(t, loop.tokenizer) for t in base]
        base_tasks = [t for t in tasks for _ in range(n_base)]
        prompts, reflection_ids, parsed = self.reflect(loop, base, base_tasks, params, step_level)
        retry_of: list[int] = []
        requests = []
        for i, (traj, (reflection, _)) in enumerate(zip(base, parsed)):
            if reflection is None or reflection.trajectory_outcome == "success" or traj.reward_error:
                continue
            if self.retry_below_max_reward_only and traj.reward >= self.max_reward:
                continue
            k = reflection.retry_from_step
            task = tasks[i // n_base]
            retry_of.append(i)
            # A step pivot continues the one message from its first k steps; a turn pivot replays k turns.
            prefix = {"response_prefix": traj.turns[:k]} if step_level else {"prefix": traj.turns[:k]}
            requests.append(EpisodeRequest(task=task, guidance=self.guidance(reflection), info={"pivot": k}, **prefix))
        retries = loop.run(requests, params) if requests else []
        if step_level:
            # The continuation is the last turn; splitting it keeps the k verbatim steps as they are.
            retries = [split_final_turn(r, loop.tokenizer) for r in retries]
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
                    sft.extend(self.meta_task_samples(base[i], prompts[i], reflection_ids[i], retry, k))
        refills = self.refill(loop, tasks, group_size, n_base, distilled_by_base, params, step_level)
        groups = []
        for ti, task in enumerate(tasks):
            members = []
            for i in range(ti * n_base, (ti + 1) * n_base):
                members.append(base[i])
                if i in distilled_by_base:
                    members.append(distilled_by_base[i])
            groups.append(Group(task.task_id, members + refills[ti], task))
        metrics = self.metrics(base, parsed, retry_of, retries, improved)
        metrics["rollout/refill_rate"] = sum(len(r) for r in refills) / (len(tasks) * group_size)
        return Exploration(groups=groups, sft=sft, metrics=metrics)

    def refill(
        self,
        loop: AgentLoop,
        tasks: list[Task],
        group_size: int,
        n_base: int,
        distilled_by_base: dict[int, Trajectory],
        params: SamplingParams,
        step_level: bool,
    ) -> list[list[Trajectory]]:
        """Fresh samples per task for the slots no retry filled (``refill_groups``), in one engine call."""
        if not self.refill_groups:
            return [[] for _ in tasks]
        missing = [
            group_size - n_base - sum(i in distilled_by_base for i in range(ti * n_base, (ti + 1) * n_base))
            for ti in range(len(tasks))
        ]
        requests = [EpisodeRequest(task=task) for task, count in zip(tasks, missing) for _ in range(count)]
        fresh = loop.run(requests, params) if requests else []
        if step_level:
            fresh = [split_final_turn(t, loop.tokenizer) for t in fresh]
        in_order = iter(fresh)
        return [[next(in_order) for _ in range(count)] for count in missing]

    def reflect(
        self,
        loop: AgentLoop,
        trajectories: list[Trajectory],
        tasks: list[Task],
        params: SamplingParams,
        step_level: bool = False,
    ) -> tuple[list[list[int]], list[list[int]], list[tuple[Optional[Reflection], str]]]:
        """A reflection on each trajectory (of the matching task in ``tasks``): the reflection prompts'
        tokens, the reflections' tokens and the parsed reflections (``parse_reflection``'s pairs).

        The ``policy`` reflector answers all prompts in one batched engine call at
        ``reflection_temperature`` (and the rollout's top-p); the ``suite`` reflector asks the
        suite's diagnostician. ``step_level``: the trajectories are split into step turns, which the
        transcripts number and ``retry_from_step`` indexes. Each trajectory's ``info`` gets the
        reflection text and the parse error ("" when valid)."""
        tokenizer = loop.tokenizer if step_level else None
        messages = [self.reflection_prompt(t, tokenizer) for t in trajectories]
        if self.reflector == "suite":
            prompts = standalone_prompts(loop, messages)
            texts = scripted_reflections(loop.suite, trajectories, tasks)
            answers = target_tokens(loop.tokenizer, texts)
        else:
            reflect_params = SamplingParams(
                temperature=self.reflection_temperature, top_p=params.top_p, max_new_tokens=self.max_reflection_tokens
            )
            prompts, generations = ask_policy(loop, messages, reflect_params)
            answers = [g.token_ids for g in generations]
            texts = [loop.tokenizer.decode(ids, skip_special_tokens=True) for ids in answers]
        parsed = [parse_reflection(text, len(t.turns)) for text, t in zip(texts, trajectories)]
        for trajectory, text, (_, error) in zip(trajectories, texts, parsed):
            # Kept on the trajectory so rollout sample logs show what was written and why it failed.
            trajectory.info["reflection"] = text
            trajectory.info["reflection_error"] = error
        return prompts, answers, parsed

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
        # Does the reflection's outcome match the environment's verdict? Both success labels count as
        # claiming success.
        judged = [(r.trajectory_outcome != "failure") == t.success for t, (r, _) in zip(base, parsed) if r is not None]
        positions = [retry.info["pivot"] / max(len(base[i].turns), 1) for i, retry in zip(retry_of, retries)]
        saved = sum(sum(len(t.response_ids) for t in base[i].turns[: r.info["pivot"]]) for i, r in zip(retry_of, retries))
        return {
            "rollout/reflection_invalid_rate": invalid / max(len(parsed), 1),
            "rollout/reflection_outcome_agreement": sum(judged) / len(judged) if judged else 0.0,
            "rollout/retry_rate": len(retries) / max(len(base), 1),
            "rollout/retry_improvement_rate": improved / max(len(retries), 1),
            "rollout/pivot_position": sum(positions) / len(positions) if positions else 0.0,
            "rollout/retry_tokens_saved": float(saved),
        }


def scripted_reflections(suite, trajectories: list[Trajectory], tasks: list[Task]) -> list[str]:
    """The suite diagnostician's reflection (JSON text) on each played trajectory of the matching task."""
    texts = []
    for trajectory, task in zip(trajectories, tasks):
        diagnosis = suite.diagnose(task, trajectory.actions, [turn.feedback for turn in trajectory.turns])
        if diagnosis is None:
            raise ValueError(
                f"reflector 'suite': {type(suite).__name__} has no diagnostician (diagnose returned None for "
                f"task {task.task_id!r}); use reflector 'policy'"
            )
        texts.append(json.dumps(diagnosis))
    return texts


def scripted_reflection_samples(
    loop: AgentLoop, explorer: ReflectRetryExplorer, tasks: list[Task], rng: random.Random
) -> list[Trajectory]:
    """Warm-start SFT data from a suite's scripted diagnostician (procedural worlds have one).

    For each task: the expert plan with one injected mistake (a random admissible action at a random
    step), continued like the policy's own episodes are: half the time by the expert's recovery (a
    success, often an inefficient one), half the time by random admissible actions until the episode
    ends; the diagnostician's reflection of it (reflect sample), and the expert's continuation from
    the pivot under the guidance (retry sample).
    """
    suite = loop.suite
    samples: list[Trajectory] = []
    flawed_actions = []
    for task in tasks:
        plan = suite.demonstration(task) or []
        step = rng.randrange(max(len(plan), 1))
        actions = plan[:step] + [_wrong_action(suite, task, plan[:step], plan[step] if step < len(plan) else None, rng)]
        if rng.random() < 0.5:
            actions += suite.expert_continuation(task, actions) or []
        else:
            actions += _random_actions(suite, task, actions, len(plan) + 2, rng)
        flawed_actions.append(actions)
    flawed = loop.play_actions([EpisodeRequest(task=t) for t in tasks], flawed_actions, allow_unfinished=True)
    retry_requests, retry_actions = [], []
    for task, traj in zip(tasks, flawed):
        diagnosis = suite.diagnose(task, traj.actions, [t.feedback for t in traj.turns])
        if diagnosis is None:
            continue
        k = min(int(diagnosis["retry_from_step"]), len(traj.turns) - 1)
        diagnosis = {**diagnosis, "retry_from_step": k}
        [prompt] = standalone_prompts(loop, [explorer.reflection_prompt(traj)])
        [answer] = target_tokens(loop.tokenizer, [json.dumps(diagnosis)])
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


def _replayed(suite, task: Task, prefix: list[str]):
    """(environment reset to ``task`` with ``prefix`` played, admissible actions after it, episode over)."""
    env = suite.make_env()
    env.reset(task)
    result = None
    for action in prefix:
        result = env.step(action)
    admissible = list(result.info.get("admissible_actions", [])) if result is not None else []
    return env, admissible, result is not None and result.done


def _random_actions(suite, task: Task, prefix: list[str], count: int, rng: random.Random) -> list[str]:
    """Up to ``count`` random admissible actions played after ``prefix`` (fewer when the episode ends)."""
    env, admissible, done = _replayed(suite, task, prefix)
    actions: list[str] = []
    while len(actions) < count and admissible and not done:
        actions.append(rng.choice(admissible))
        result = env.step(actions[-1])
        admissible, done = list(result.info.get("admissible_actions", [])), result.done
    return actions


def _wrong_action(suite, task: Task, prefix: list[str], correct: Optional[str], rng: random.Random) -> str:
    _, admissible, _ = _replayed(suite, task, prefix)
    if not admissible:
        _, admissible, _ = _replayed(suite, task, ["look"])
    choices = [a for a in admissible if a != correct] or ["look"]
    return rng.choice(choices)
