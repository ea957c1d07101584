"""The agent loop: plays many episodes at once, one batched engine call per turn.

This is the one place where tokens are booked. Each turn records the context tokens appended before
it and the exact tokens and log-probs the engine returned; the trajectory's token sequence is the
conversation the policy actually saw. Single-turn tasks are one-step episodes of the same loop.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

from r3lightning.engines.base import Generation, RolloutEngine, SamplingParams
from r3lightning.envs.base import AnswerFormat, Environment, StepResult, Task, TaskSuite
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.rollout.env_calls import EnvCaller, SuiteCalls, check_reset_result, check_step_result, check_suite
from r3lightning.types import GuidedTurn, Trajectory, Turn, message_count

INVALID_FORMAT_FEEDBACK = "Invalid action format. Reply with exactly one action inside {open}...{close}."


@dataclass
class AgentLoopConfig:
    """How episodes are played.

    Args:
        max_context_tokens: an episode whose context would exceed this ends as truncated.
        action_format: ``tag`` (the action is the text inside <action_tag>...</action_tag>), ``line``
            (first non-empty line of the response) or ``raw`` (the whole response, e.g. a math solution);
            null (default): the suite's ``answer_format`` (``raw`` for math), ``tag`` when it declares
            none. A value that contradicts the suite's ``answer_format`` is refused.
        action_tag: tag name for the ``tag`` format.
        invalid_action: what to do when no action can be parsed: ``feedback`` (tell the policy and go
            on; the turn still counts toward the step limit) or ``end`` (end the episode with reward 0).
        step_timeout_s: deadline for one environment ``reset`` or ``step`` (reward code that hangs is abandoned, the
            sample is masked and counted in ``reward/error_rate``); null disables the deadline.
        guidance_template: how R³L guidance is shown with the pivot observation; ``{guidance}`` and
            ``{observation}`` are filled in.
        invalid_action_penalty: subtracted from the episode's reward for every turn whose action was
            malformed (none could be parsed) or rejected by the environment (``info["invalid_action"]``),
            replayed prefix turns included; success is untouched. Both kinds must cost the same: with a
            penalty on rejected commands alone, a policy learns to write malformed actions instead.
        reward_out_of_range: an environment reward outside [0, 1] is ``clip``ped into it, or ``mask``ed
            like a reward error; either way it is counted (``reward/clipped_count``,
            ``reward/invalid_count``). A reward that is not a finite number (None, NaN, text) is always
            masked and counted in ``reward/invalid_count``, with a one-time warning naming the
            environment and the task.
    """

    max_context_tokens: int = 2048
    action_format: Optional[AnswerFormat] = None
    action_tag: str = "action"
    invalid_action: Literal["feedback", "end"] = "feedback"
    step_timeout_s: Optional[float] = 30.0
    guidance_template: str = (
        "{observation}\n\n[Guidance from a previous attempt - use it, but do not mention it]\n{guidance}"
    )
    invalid_action_penalty: float = 0.0
    reward_out_of_range: Literal["clip", "mask"] = "clip"

    def __post_init__(self) -> None:
        if self.invalid_action_penalty < 0:
            raise ValueError(f"agent.invalid_action_penalty must be >= 0, got {self.invalid_action_penalty}")
        if self.reward_out_of_range not in ("clip", "mask"):
            raise ValueError(f"agent.reward_out_of_range must be 'clip' or 'mask', got {self.reward_out_of_range!r}")


@dataclass
class EpisodeRequest:
    """One episode to play.

    Args:
        prefix: turns to reuse verbatim; their actions are replayed in a fresh environment and their
            tokens are kept (R³L retry from a pivot). The episode continues at turn ``len(prefix)``.
        guidance: text shown with the observation of turn ``len(prefix)`` (and only there).
        response_prefix: step turns that begin the assistant message of turn ``len(prefix)`` (R³L
            step-level retry): their tokens follow that turn's context verbatim, generation continues
            from them, and the action is parsed from the whole message. They are booked before the
            generated continuation: the first with the turn's context, the others with none.
    """

    task: Task
    origin: str = "base"
    prefix: list[Turn] = field(default_factory=list)
    guidance: Optional[str] = None
    response_prefix: list[Turn] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    """Diagnostics copied into the trajectory's ``info`` (never read to decide anything)."""


@dataclass
class _Episode:
    index: int
    request: EpisodeRequest
    env: Environment
    turns: list[Turn]
    pending_context: list[int]
    context_len: int
    reward: float = 0.0
    success: bool = False
    done: bool = False
    end_reason: str = ""
    reward_error: bool = False
    invalid_actions: int = 0
    rejected_actions: int = 0
    unguided_context: Optional[list[int]] = None
    guided_turn: Optional[GuidedTurn] = None
    pending_observation: str = ""
    env_error: str = ""
    reward_invalid: bool = False
    reward_clipped: bool = False
    partial_credit: Optional[float] = None


def resolve_action_format(suite: TaskSuite, config: AgentLoopConfig) -> AgentLoopConfig:
    """A copy of ``config`` whose ``action_format`` is set: the suite's ``answer_format`` when unset
    (``tag`` for a suite that declares none). Raises ValueError naming both keys when they disagree: a
    math answer looked for inside ``<action>`` tags is never found, and every reward would be 0."""
    declared = getattr(suite, "answer_format", None)
    chosen = config.action_format
    if chosen is not None and declared is not None and chosen != declared:
        raise ValueError(
            f"data.agent.action_format is {chosen!r} but data.suite ({type(suite).__name__}) answers in {declared!r} "
            f"format (its answer_format): no action would parse and every reward would be 0; set "
            f"data.agent.action_format: {declared} or leave it unset"
        )
    return dataclasses.replace(config, action_format=chosen or declared or "tag")


def parse_action(response: str, config: AgentLoopConfig) -> Optional[str]:
    """Extract the action from a response; None when the format is not met. An unset
    ``action_format`` reads as ``tag`` (``AgentLoop`` resolves it against its suite first)."""
    if config.action_format == "raw":
        return response
    if config.action_format == "line":
        for line in response.splitlines():
            if line.strip():
                return line.strip()
        return None
    match = re.search(rf"<{config.action_tag}>(.*?)</{config.action_tag}>", response, flags=re.DOTALL)
    if match is None or not match.group(1).strip():
        return None
    return match.group(1).strip()


def render_action(action: str, config: AgentLoopConfig) -> str:
    """The assistant text that makes ``parse_action`` return ``action``."""
    if config.action_format in ("tag", None):
        return f"<{config.action_tag}>{action}</{config.action_tag}>"
    return action


class AgentLoop:
    """Plays batches of episodes of ``suite`` with ``engine``.

    Trajectories carry why they ended (``end_reason``), their malformed and rejected action counts
    and, for guided episodes, the ``guided_turn`` (its index and the context tokens it would have had
    without guidance), so context distillation swaps exactly those tokens and nothing else.
    """

    def __init__(self, suite: TaskSuite, engine: RolloutEngine, tokenizer, config: AgentLoopConfig | None = None) -> None:
        self.suite = suite
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = resolve_action_format(suite, config or AgentLoopConfig())
        check_suite(suite)
        self.chat = ChatFormatter(tokenizer, suite.system_prompt)
        if suite.max_turns > 1:  # refused now, not at the first second turn
            self.chat.require_prefix_stable(f"data.suite ({type(suite).__name__}) plays up to {suite.max_turns} turns")
        self.generated_tokens = 0
        self._call = EnvCaller()
        self.env_calls = SuiteCalls(suite, self.config.step_timeout_s, "warm-start data", self._call)
        """Single environment calls outside episodes (scripted warm-start data), under the same deadline."""
        # First prompts rendered during one ``_play`` (a group's episodes share their task's prompt;
        # rendering the chat template is the costly part of starting an episode).
        self._first_prompts: dict[tuple[str, Optional[str]], list[int]] = {}
        # Task.history of the tasks played that have one, by task id: ``rerender`` renders their first prompt.
        self._histories: dict[str, list[dict]] = {}
        self._too_long_warned: set[str] = set()  # tasks whose first prompt did not fit, warned once each

    def warn_prompt_too_long(self, task_id: str, prompt_tokens: int) -> None:
        """The one warning for a task (a data row: ``jsonl:file.jsonl#row3`` names the file and the
        0-based row) whose first prompt does not fit in the context, wherever it falls: at the setup
        check or the first rollout that draws it. Its episodes end before their first token, train
        nothing and are counted in ``rollout/prompt_too_long_rate``."""
        if task_id in self._too_long_warned:
            return
        self._too_long_warned.add(task_id)
        warnings.warn(
            f"task {task_id!r}: its first prompt ({prompt_tokens} tokens) does not fit in data.agent.max_context_tokens "
            f"({self.config.max_context_tokens}); its episodes are skipped (they end before their first token, train "
            "nothing and are counted in rollout/prompt_too_long_rate). Drop or shorten that row, or raise "
            "data.agent.max_context_tokens",
            stacklevel=2,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """The engine's completions of ``prompts``; every generation of a rollout (episode turns,
        reflections, critiques) goes through here, so ``generated_tokens`` counts what it cost."""
        generations = self.engine.generate(prompts, params)
        self.generated_tokens += sum(len(g.token_ids) for g in generations)
        return generations

    def rerender(self, trajectory: Trajectory) -> Trajectory:
        """``trajectory`` with its context tokens rendered by this loop's chat template from the
        observations it stored (generated tokens untouched), when the template has changed since it
        was played; the trajectory itself when its first prompt is what this loop would render."""
        if not trajectory.turns or not trajectory.turns[0].observation:
            return trajectory
        first = self.chat.first_prompt(trajectory.turns[0].observation, self._histories.get(trajectory.task_id))
        if first == trajectory.turns[0].context_ids:
            return trajectory
        turns, previous_eos = [], False
        for i, turn in enumerate(trajectory.turns):
            context = [] if not turn.context_ids else first if i == 0 else self.chat.next_user_turn(turn.observation, previous_eos)
            turns.append(dataclasses.replace(turn, context_ids=context))
            previous_eos = turn.response_ids[-1:] == [self.tokenizer.eos_token_id]
        return dataclasses.replace(trajectory, turns=turns)

    def run(self, requests: list[EpisodeRequest], params: SamplingParams) -> list[Trajectory]:
        """Play every request to the end; one batched engine call per turn of all active episodes."""

        def sample(episodes: list[_Episode]) -> list[Generation]:
            return self.generate([self._full_context(ep) for ep in episodes], params)

        return self._play(requests, sample)

    def run_scripted(
        self, requests: list[EpisodeRequest], responses: list[list[list[int]]], allow_unfinished: bool = False,
        source: str = "the scripted responses", fix: str = "",
    ) -> list[Trajectory]:
        """Play fixed responses (token ids per turn, per request) instead of sampling.

        Demonstrations go through exactly the bookkeeping of sampled episodes; their log-probs are 0
        (they are trained by the SFT head, which ignores behaviour log-probs). An episode whose
        responses run out before it ends is an error (``ScriptEndedEarly``, naming ``source``, the
        task and ``fix``), unless ``allow_unfinished`` (then it ends with ``end_reason="script_end"``).
        """
        queues = [list(r) for r in responses]

        def replay(episodes: list[_Episode]) -> list[Optional[Generation]]:
            out: list[Optional[Generation]] = []
            for ep in episodes:
                if not queues[ep.index]:
                    if not allow_unfinished:
                        given = len(responses[ep.index])
                        raise ScriptEndedEarly(
                            f"{source} (task {ep.request.task.task_id!r}) ended before the episode did ({given} "
                            f"action{'s' if given != 1 else ''} given, {len(ep.turns)} turn{'s' if len(ep.turns) != 1 else ''} played, up to "
                            f"{self.suite.max_turns} allowed, and the environment had not said done)" + (f"; {fix}" if fix else "")
                        )
                    out.append(None)
                    continue
                ids = queues[ep.index].pop(0)
                out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop"))
            return out

        return self._play(requests, replay)

    def play_actions(
        self, requests: list[EpisodeRequest], actions: list[list[str]], allow_unfinished: bool = False,
        source: str = "the scripted actions", fix: str = "",
    ) -> list[Trajectory]:
        """Play fixed action strings (rendered in the loop's action format, ended by end-of-turn);
        ``source`` and ``fix`` as in ``run_scripted``."""
        eos = self.tokenizer.eos_token_id
        responses = [
            [self.tokenizer(render_action(a, self.config), add_special_tokens=False)["input_ids"] + [eos] for a in acts]
            for acts in actions
        ]
        return self.run_scripted(requests, responses, allow_unfinished, source, fix)

    def _play(self, requests: list[EpisodeRequest], respond: Callable[[list["_Episode"]], list[Optional[Generation]]]) -> list[Trajectory]:
        self._first_prompts.clear()
        try:
            episodes = self._start(requests)
            while True:
                active = [ep for ep in episodes if not ep.done]
                if not active:
                    break
                self._play_turn(active, respond)
        finally:
            self._first_prompts.clear()
        return [self._finish(ep) for ep in episodes]

    def _observation_message(self, ep: _Episode, observation: str) -> str:
        if ep.request.guidance is not None and len(ep.turns) == len(ep.request.prefix):
            return self.config.guidance_template.format(observation=observation, guidance=ep.request.guidance)
        return observation

    def _response_prefix(self, ep: _Episode) -> list[Turn]:
        """The step turns the message in progress starts with (only the message at the pivot has any)."""
        return ep.request.response_prefix if len(ep.turns) == len(ep.request.prefix) else []

    def _context_for(self, ep: _Episode, message: str, previous_eos: bool) -> list[int]:
        if not ep.turns:
            task = ep.request.task
            key = (message, task.task_id if task.history else None)
            if key not in self._first_prompts:
                if task.history:
                    self._histories[task.task_id] = task.history
                self._first_prompts[key] = self.chat.first_prompt(message, task.history)
            return list(self._first_prompts[key])
        return self.chat.next_user_turn(message, previous_eos)

    def _queue_observation(self, ep: _Episode, observation: str) -> None:
        """Book the tokens of the next user message, and where the guidance sits inside them."""
        previous_eos = bool(ep.turns) and ep.turns[-1].response_ids[-1:] == [self.tokenizer.eos_token_id]
        message = self._observation_message(ep, observation)
        ep.pending_observation = observation
        ep.pending_context = self._context_for(ep, message, previous_eos)
        if message != observation:
            ep.unguided_context = self._context_for(ep, observation, previous_eos)

    def _start(self, requests: list[EpisodeRequest]) -> list[_Episode]:
        """An episode per request, its environment reset and its prefix (if any) replayed. The resets go
        to the env-call thread in one hand-off, as a turn's steps do: a hand-off per episode cost ~0.1 ms,
        7 ms of the GRPO benchmark's 64-episode rollout."""
        episodes = [
            _Episode(index=index, request=request, env=self.suite.make_env(), turns=[], pending_context=[], context_len=0)
            for index, request in enumerate(requests)
        ]
        outcomes = self._call.call_each([(ep.env.reset, (ep.request.task,)) for ep in episodes], self.config.step_timeout_s)
        observations = {}
        for ep, outcome in zip(episodes, outcomes):
            observation = self._reset_outcome(ep, outcome)
            if observation is not None:
                observations[ep.index] = observation
        self._replay_prefixes([ep for ep in episodes if ep.index in observations], observations)
        for ep in episodes:
            if ep.index in observations and not ep.done:
                self._queue_observation(ep, observations[ep.index])
        return episodes

    def _replay_prefixes(self, episodes: list[_Episode], observations: dict[int, str]) -> None:
        """Replay the requests' prefix turns in their environments, turn by turn, each turn's steps in one
        hand-off (so a turn's hanging replays are cut together, not one deadline each); ``observations``
        (episode index -> latest observation) is updated as they go."""
        position = 0
        replaying = [ep for ep in episodes if ep.request.prefix]
        while replaying:
            stepping = []
            for ep in replaying:
                turn = ep.request.prefix[position]
                ep.turns.append(turn)
                ep.context_len += len(turn.context_ids) + len(turn.response_ids)
                if turn.malformed:
                    # As it happened: no environment step, the format feedback is the next message.
                    ep.invalid_actions += 1
                    observations[ep.index] = turn.feedback
                else:
                    stepping.append((ep, turn.action))
            outcomes = self._call.call_each([(ep.env.step, (action,)) for ep, action in stepping], self.config.step_timeout_s)
            for (ep, _), outcome in zip(stepping, outcomes):
                result = self._step_outcome(ep, outcome)
                if result is None or result.done:
                    # The environment did not replay the prefix as it played it (a verifier timeout, an error,
                    # an episode that ended): this retry is lost, not the step. The explorer drops and counts it.
                    ep.done, ep.end_reason, ep.reward_error, ep.reward = True, "replay_failed", True, 0.0
                    continue
                observations[ep.index] = result.observation
            position += 1
            replaying = [ep for ep in replaying if not ep.done and position < len(ep.request.prefix)]

    def _reset_outcome(self, ep: _Episode, outcome: tuple[bool, object]) -> Optional[str]:
        """The first observation, or None when ``reset`` failed or hung (the episode then ends as an
        environment error with no turn, like a failed step). Malformed results are refused."""
        ok, observation = outcome
        if not ok:
            self._env_failed(ep, observation)
            return None
        return check_reset_result(observation, ep.env, ep.request.task, self.suite)

    def _step_outcome(self, ep: _Episode, outcome: tuple[bool, object]) -> Optional[StepResult]:
        """Every environment step, live or replayed, ends here, so rejected actions are counted once: the
        result, or None when the step raised or timed out (the episode then ends as an environment error)."""
        ok, result = outcome
        if not ok:
            self._env_failed(ep, result)
            return None
        check_step_result(result, ep.env, ep.request.task, self.suite)
        ep.rejected_actions += int(bool(result.info.get("invalid_action")))
        return result

    @staticmethod
    def _env_failed(ep: _Episode, err: BaseException) -> None:
        ep.done, ep.end_reason, ep.reward_error, ep.reward = True, "env_error", True, 0.0
        ep.env_error = f"{type(err).__name__}: {err}"

    def _play_turn(self, active: list[_Episode], respond: Callable[[list[_Episode]], list[Optional[Generation]]]) -> None:
        playable = []
        for ep in active:
            started = sum(len(t.response_ids) for t in self._response_prefix(ep))
            if ep.context_len + len(ep.pending_context) + started >= self.config.max_context_tokens:
                ep.done, ep.end_reason = True, "context_limit"
                if not ep.turns:  # the first prompt itself does not fit: the row is skipped
                    self.warn_prompt_too_long(ep.request.task.task_id, len(ep.pending_context))
            else:
                playable.append(ep)
        if not playable:
            return
        generations = respond(playable)
        stepping: list[tuple[_Episode, Generation, Turn, str]] = []
        for ep, gen in zip(playable, generations):
            if gen is None:
                ep.done, ep.end_reason = True, "script_end"
                continue
            started = self._started_steps(ep)
            started_ids = [tok for step in started for tok in step.response_ids]
            ep.context_len += len(ep.pending_context) + len(started_ids)
            room = self.config.max_context_tokens - ep.context_len
            cut = len(gen.token_ids) > room
            token_ids, logprobs = gen.token_ids[:room], gen.logprobs[:room]
            # The environment grades the whole message, the verbatim steps included.
            response = self.tokenizer.decode(started_ids + token_ids, skip_special_tokens=True)
            turn = Turn(
                context_ids=[] if started else ep.pending_context,
                response_ids=token_ids,
                logprobs=logprobs,
                observation="" if started else ep.pending_observation,
            )
            if ep.unguided_context is not None:
                ep.guided_turn = GuidedTurn(len(ep.turns), ep.unguided_context)
                ep.unguided_context = None
            ep.turns.extend(started)
            ep.turns.append(turn)
            ep.context_len += len(token_ids)
            if cut:
                ep.done, ep.end_reason = True, "context_limit"
                continue
            action = parse_action(response, self.config)
            if action is None:
                turn.malformed = True
                ep.invalid_actions += 1
                if self.config.invalid_action == "end":
                    ep.done, ep.end_reason = True, "invalid_action"
                    continue
                feedback = INVALID_FORMAT_FEEDBACK.format(
                    open=f"<{self.config.action_tag}>", close=f"</{self.config.action_tag}>"
                )
                turn.feedback = feedback
                self._after_turn(ep, gen.finish_reason, StepResult(feedback, ep.reward, False, {"feedback": feedback}))
                continue
            turn.action = action
            stepping.append((ep, gen, turn, action))
        # The turn's environment steps go to the env-call thread in one hand-off (each keeps its deadline).
        outcomes = self._call.call_each([(ep.env.step, (action,)) for ep, _, _, action in stepping], self.config.step_timeout_s)
        for (ep, gen, turn, _), outcome in zip(stepping, outcomes):
            result = self._step_outcome(ep, outcome)
            if result is None:
                continue
            turn.feedback = result.feedback
            self._after_turn(ep, gen.finish_reason, result)

    def _started_steps(self, ep: _Episode) -> list[Turn]:
        """The response-prefix steps as booked: the first carries the message's context (guidance
        included, so distillation finds it at the usual turn index), the others none."""
        steps = self._response_prefix(ep)
        if not steps:
            return []
        first = dataclasses.replace(steps[0], context_ids=ep.pending_context, observation=ep.pending_observation)
        return [first, *(dataclasses.replace(step, context_ids=[]) for step in steps[1:])]

    def _after_turn(self, ep: _Episode, finish_reason: str, result: StepResult) -> None:
        self._take_reward(ep, result.reward)
        if result.info.get("reward_error"):
            ep.reward_error = True
        credit = result.info.get("partial_credit")
        ep.partial_credit = float(credit) if isinstance(credit, (int, float)) and math.isfinite(credit) else None
        if result.done:
            ep.done, ep.success = True, bool(result.info.get("success", ep.reward >= 1.0))
            ep.end_reason = "length" if finish_reason == "length" and not ep.success else "done"
            return
        if message_count(ep.turns) >= self.suite.max_turns:
            ep.done, ep.end_reason = True, "max_turns"
            return
        self._queue_observation(ep, result.observation)

    def _take_reward(self, ep: _Episode, reward: object) -> None:
        """Rewards are untrusted input: one that is not a finite number is masked like a reward error;
        one outside [0, 1] is clipped or masked (``reward_out_of_range``). Both are counted."""
        value = reward_value(reward)
        if value is None:
            ep.reward, ep.reward_error, ep.reward_invalid = 0.0, True, True
            warn_once(f"{type(ep.env).__name__} returned the reward {reward!r} for task {ep.request.task.task_id!r}: "
                      "not a finite number; the sample is masked (reward/invalid_count)")
            return
        if 0.0 <= value <= 1.0:
            ep.reward = value
            return
        if self.config.reward_out_of_range == "mask":
            ep.reward, ep.reward_error, ep.reward_invalid = 0.0, True, True
        else:
            ep.reward, ep.reward_clipped = min(max(value, 0.0), 1.0), True
        warn_once(f"{type(ep.env).__name__} returned the reward {value!r} for task {ep.request.task.task_id!r}, "
                  f"outside [0, 1]; agent.reward_out_of_range={self.config.reward_out_of_range}")

    def _full_context(self, ep: _Episode) -> list[int]:
        ids: list[int] = []
        for turn in ep.turns:
            ids.extend(turn.context_ids)
            ids.extend(turn.response_ids)
        ids.extend(ep.pending_context)
        for step in self._response_prefix(ep):
            ids.extend(step.response_ids)
        return ids

    def _finish(self, ep: _Episode) -> Trajectory:
        penalty = self.config.invalid_action_penalty * (ep.invalid_actions + ep.rejected_actions)
        return Trajectory(
            task_id=ep.request.task.task_id,
            turns=ep.turns,
            reward=0.0 if ep.reward_error else ep.reward - penalty,
            success=ep.success and not ep.reward_error,
            truncated=ep.end_reason in ("max_turns", "context_limit", "length"),
            origin=ep.request.origin,
            model_version=self.engine.weight_version,
            reward_error=ep.reward_error,
            info=dict(ep.request.info),
            end_reason=ep.end_reason,
            invalid_actions=ep.invalid_actions,
            rejected_actions=ep.rejected_actions,
            guided_turn=ep.guided_turn,
            env_error=ep.env_error,
            partial_credit=ep.partial_credit,
            reward_invalid=ep.reward_invalid,
            reward_clipped=ep.reward_clipped,
        )


class ScriptEndedEarly(ValueError):
    """Scripted responses (a suite's demonstration, an expert continuation) ran out before the episode
    ended; the message names where they came from, the task and what to change."""


def reward_value(reward: object) -> Optional[float]:
    """``reward`` as a finite float, or None (None, NaN, inf, text, containers; a bool is a number)."""
    if isinstance(reward, (bool, int, float)) or type(reward).__name__ in ("float32", "float64", "int64", "int32"):
        value = float(reward)
        return value if math.isfinite(value) else None
    if hasattr(reward, "item") and getattr(reward, "numel", lambda: 0)() == 1:  # a one-element tensor
        return reward_value(reward.item())
    return None


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Emit ``message`` as a warning the first time its environment class raises it (one line a class)."""
    key = message.split(" ", 1)[0]
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)

