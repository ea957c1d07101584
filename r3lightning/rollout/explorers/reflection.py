"""Reflection: the prompt templates, the JSON a reflection must be, and the ``Reflector`` that writes them.

A reflection is the structured self-diagnosis of R³L (and the material of Reflect-GRPO): a JSON object
with a summary, a root cause, the outcome (``success``, ``success_but_inefficient``, ``failure``), a
suggestion and ``retry_from_step`` — the 0-based turn (or reasoning step) from which a retry should
start. Explorers compose a ``Reflector`` rather than inherit from each other; the templates and
transcripts here are also shared with Critique-GRPO's critiques.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, Optional

from r3lightning.engines.base import Generation, SamplingParams
from r3lightning.envs.base import Task
from r3lightning.rollout.agent_loop import AgentLoop
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.rollout.explorers.base import GuidanceBudget
from r3lightning.types import Trajectory

OUTCOMES = ("success", "success_but_inefficient", "failure")
REFLECTION_FIELDS = ("trajectory_summary", "root_cause_analysis", "trajectory_outcome", "improvement_suggestion", "retry_from_step")
REFLECTION_TEMPERATURE = 1.0
"""The temperature the policy's reflections are sampled at unless an explorer sets one."""
MAX_REFLECTION_TOKENS = 192
"""A reflection's generation budget unless an explorer sets one."""


def load_template(path: str, builtin: str) -> str:
    """The prompt template at ``path``, or the package's ``templates/<builtin>`` when ``path`` is empty."""
    if path:
        with open(path) as handle:
            return handle.read()
    return resources.files("r3lightning").joinpath("templates", builtin).read_text()


def reflection_templates(reflection_template: str, guidance_template: str, reflection_format: str) -> tuple[str, str]:
    """The reflection and guidance templates at the given paths, or the built-in ones of the format
    (``reflection_text.txt`` / ``guidance_text.txt`` for ``text``, ``reflection.txt`` / ``guidance.txt``
    for ``json``)."""
    suffix = "_text" if reflection_format == "text" else ""
    return (load_template(reflection_template, f"reflection{suffix}.txt"),
            load_template(guidance_template, f"guidance{suffix}.txt"))


@dataclass
class Reflection:
    """A validated reflection. ``retry_from_step`` is within [0, number of turns - 1]. ``judged``: the
    outcome is the reflection's own judgment (a ``json`` reflection); a ``text`` reflection's outcome is
    the environment's verdict, which no success judgment is trained on or scored against."""

    trajectory_summary: str
    root_cause_analysis: str
    trajectory_outcome: str
    improvement_suggestion: str
    retry_from_step: int
    judged: bool = True


REFLECTION_FORMATS = ("json", "text")
"""How a reflection is written: the paper's JSON object, or free text (``parse_text_reflection``)."""
_STEP_MENTION = re.compile(r"\bstep\s+(\d+)", re.IGNORECASE)


def parse_text_reflection(text: str, trajectory: Trajectory) -> tuple[Optional[Reflection], str]:
    """A free-text reflection on ``trajectory``: (reflection, "") or (None, "empty"). Never raises.

    For a policy too small to write the JSON object: the whole text is the root cause and the
    suggestion; the pivot is the first ``Step k`` the text names within [0, turns - 1] (the transcript
    numbers steps from 0), else 0 (retry from the start); the outcome is the environment's verdict
    (``judged`` False)."""
    body = text.strip()
    if not body:
        return None, "empty"
    turns = max(len(trajectory.turns), 1)
    named = [int(m) for m in _STEP_MENTION.findall(body) if int(m) < turns]
    outcome = "success" if trajectory.success else "failure"
    return Reflection("", body, outcome, body, named[0] if named else 0, judged=False), ""


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
    return prompts, (loop.generate(prompts, params) if prompts else [])


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


def full_transcript(trajectory: Trajectory, tokenizer, system_prompt: str) -> str:
    """The whole episode as the reference code shows it to the reflector: the system prompt, then
    every observation, the full response (thoughts and action) and the environment's feedback."""
    lines = [f"System: {system_prompt}"] if system_prompt else []
    for i, turn in enumerate(trajectory.turns):
        if turn.observation:
            lines.append(f"Observation {i}: {turn.observation}")
        lines.append(f"Response {i}: {tokenizer.decode(turn.response_ids, skip_special_tokens=True).strip() or '(empty)'}")
        lines.append(f"Feedback {i}: {turn.feedback or '(no feedback)'}")
    return "\n".join(lines) or "(no steps)"


def outcome_text(trajectory: Trajectory) -> str:
    state = "succeeded" if trajectory.success else "failed"
    return f"{state} after {len(trajectory.turns)} steps with reward {trajectory.reward:g}"


def diagnosis_of(suite, task: Task, trajectory: Trajectory) -> Optional[dict[str, Any]]:
    """The suite diagnostician's reflection on a played trajectory, or None when the suite has none.

    Its ``retry_from_step`` is clamped to the trajectory's last turn: a failure whose every action was
    on a shortest path (it ran out of turns) is diagnosed after its last action, where no retry can
    start, so the reflection that the warm-start teaches, the ``suite`` reflector writes and
    ``rollout/pivot_accuracy`` checks against all name the last turn instead."""
    diagnosis = suite.diagnose(task, trajectory.actions, [turn.feedback for turn in trajectory.turns])
    if diagnosis is None:
        return None
    last = max(len(trajectory.turns) - 1, 0)
    return {**diagnosis, "retry_from_step": min(int(diagnosis["retry_from_step"]), last)}


def scripted_reflections(suite, trajectories: list[Trajectory], tasks: list[Task]) -> list[str]:
    """The suite diagnostician's reflection (JSON text, ``diagnosis_of``) on each played trajectory of
    the matching task."""
    texts = []
    for trajectory, task in zip(trajectories, tasks):
        diagnosis = diagnosis_of(suite, task, trajectory)
        if diagnosis is None:
            raise ValueError(
                f"reflector 'suite': {type(suite).__name__} has no diagnostician (diagnose returned None for "
                f"task {task.task_id!r}); use reflector 'policy'"
            )
        texts.append(json.dumps(diagnosis))
    return texts


@dataclass
class Reflections:
    """The reflections on a list of trajectories, index-aligned with it.

    prompts: the reflection prompts' tokens (a fresh conversation each).
    answers: the reflections' tokens as written (by the policy, or the scripted diagnostician's text).
    parsed: ``parse_reflection``'s (reflection, error) pairs.
    """

    prompts: list[list[int]]
    answers: list[list[int]]
    parsed: list[tuple[Optional[Reflection], str]]


class Reflector:
    """Writes and parses reflections, and turns them into guidance.

    Args:
        temperature: sampling temperature of the policy's reflections.
        max_tokens: generation budget of one reflection.
        reflection_template: reflection prompt template text with ``{transcript}`` and ``{outcome}``.
        guidance_template: guidance template text with the reflection's field names.
        source: ``policy`` (the policy reflects, one batched generation) or ``suite`` (the suite's
            scripted diagnostician, ``TaskSuite.diagnose``).
        transcript_style: ``compact`` (the first observation, then one ``action -> feedback`` line per
            step) or ``full`` (the reference code's: system prompt, every observation, full response
            and feedback; longer prompts).
        reflection_format: ``json`` (the paper's object, ``parse_reflection``) or ``text`` (free text,
            ``parse_text_reflection``; the policy source only).
    """

    @classmethod
    def with_builtin_templates(cls) -> Reflector:
        """The policy's reflector at the default settings with the built-in templates: what scripted
        reflection data and the tokenizer corpus use when the explorer has no reflector of its own."""
        return cls(REFLECTION_TEMPERATURE, MAX_REFLECTION_TOKENS, load_template("", "reflection.txt"), load_template("", "guidance.txt"))

    def __init__(
        self,
        temperature: float,
        max_tokens: int,
        reflection_template: str,
        guidance_template: str,
        source: Literal["policy", "suite"] = "policy",
        transcript_style: Literal["compact", "full"] = "compact",
        reflection_format: Literal["json", "text"] = "json",
    ) -> None:
        if source not in ("policy", "suite"):
            raise ValueError(f"reflector must be 'policy' or 'suite', got {source!r}")
        if reflection_format not in REFLECTION_FORMATS:
            raise ValueError(f"reflection_format must be 'json' or 'text', got {reflection_format!r}")
        if reflection_format == "text" and source == "suite":
            raise ValueError("reflection_format 'text' is for the policy's own reflections; the suite's diagnostician writes JSON")
        self.reflection_format = reflection_format
        if transcript_style not in ("compact", "full"):
            raise ValueError(f"reflection_transcript must be 'compact' or 'full', got {transcript_style!r}")
        self.transcript_style = transcript_style
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.reflection_template = reflection_template
        self.guidance_template = guidance_template
        self.source = source

    def prompt(self, trajectory: Trajectory, loop: Optional[AgentLoop] = None, step_level: bool = False) -> str:
        """The reflection request. ``step_level``: ``trajectory`` is split into reasoning steps, shown
        decoded and numbered (``step_transcript``); ``transcript_style: full`` shows the whole episode
        (``full_transcript``). Both need the ``loop`` (its tokenizer and system prompt)."""
        if step_level:
            shown = step_transcript(trajectory, loop.tokenizer)
        elif self.transcript_style == "full" and loop is not None:
            shown = full_transcript(trajectory, loop.tokenizer, loop.suite.system_prompt)
        else:
            shown = transcript(trajectory)
        return self.reflection_template.format(transcript=shown, outcome=outcome_text(trajectory))

    def guidance_budget(self) -> GuidanceBudget:
        """The guidance template with empty fields, and the reflection's token budget that fills them."""
        empty = {f.name: "" for f in dataclasses.fields(Reflection)}
        return GuidanceBudget(self.guidance_template.format(**empty).strip(), self.max_tokens)

    def guidance(self, reflection: Reflection | dict[str, Any]) -> str:
        fields = dataclasses.asdict(reflection) if isinstance(reflection, Reflection) else reflection
        return self.guidance_template.format(**fields).strip()

    def reflect(
        self,
        loop: AgentLoop,
        trajectories: list[Trajectory],
        tasks: list[Task],
        params: SamplingParams,
        step_level: bool = False,
    ) -> Reflections:
        """A reflection on each trajectory (of the matching task in ``tasks``).

        The ``policy`` source answers all prompts in one batched engine call at ``temperature`` (and
        the rollout's top-p); the ``suite`` source asks the suite's diagnostician. ``step_level``: the
        trajectories are split into step turns, which the transcripts number and ``retry_from_step``
        indexes. Each trajectory's ``info`` gets the reflection text and its parse error ("" when
        valid), for the sample logs."""
        messages = [self.prompt(t, loop, step_level) for t in trajectories]
        if self.source == "suite":
            prompts = standalone_prompts(loop, messages)
            texts = scripted_reflections(loop.suite, trajectories, tasks)
            answers = target_tokens(loop.tokenizer, texts)
        else:
            reflect_params = SamplingParams(
                temperature=self.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p, max_new_tokens=self.max_tokens
            )
            prompts, generations = ask_policy(loop, messages, reflect_params)
            answers = [g.token_ids for g in generations]
            texts = [loop.tokenizer.decode(ids, skip_special_tokens=True) for ids in answers]
        if self.reflection_format == "text":
            parsed = [parse_text_reflection(text, t) for text, t in zip(texts, trajectories)]
        else:
            parsed = [parse_reflection(text, len(t.turns)) for text, t in zip(texts, trajectories)]
        for trajectory, text, (_, error) in zip(trajectories, texts, parsed):
            trajectory.info["reflection"] = text
            trajectory.info["reflection_error"] = error
        return Reflections(prompts, answers, parsed)
