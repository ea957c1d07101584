"""The LightningDataModule: a stream of task batches, and the rollouts made from them.

Lightning prefetches one batch from iterable datasets. Rollouts made in the dataset would therefore
be generated with weights one update old. Here the dataset yields only *tasks* (a pure function of
their index, so prefetching is harmless) and the module calls ``rollout`` inside ``training_step``:
rollout *k* always uses the weights after update *k-1*. The cursor counts *consumed* batches, so a
checkpoint taken mid-run resumes at exactly the next unseen batch.

The module uses the datamodule through three methods: ``connect`` (once: the engine and tokenizer
every rollout uses, and the objective, whose pairing with the explorer is checked there),
``rollout(batch, phase)`` (each training step: a ``StepRollout``, the exploration with everything the
objective reads from the data side) and ``evaluate`` (validation episodes).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
from dataclasses import dataclass
from typing import Iterator, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.envs.base import Task, TaskSuite
from r3lightning.envs.jsonl import numbered_jsonl_rows
from r3lightning.rollout.agent_loop import (
    INVALID_FORMAT_FEEDBACK,
    AgentLoop,
    AgentLoopConfig,
    EpisodeRequest,
    render_action,
    resolve_action_format,
)
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.data.state_checks import expect_int
from r3lightning.rollout.env_calls import SuiteCalls, check_suite
from r3lightning.engines.base import RolloutEngine, SamplingParams
from r3lightning.rollout.explorers.base import Exploration, ExplorationSpec, Explorer, SampleExplorer
from r3lightning.data.combinations import check_combination
from r3lightning.data.replay import ReplayBuffer, ReplayConfig, check_replay_state, record_step, replay_into_groups
from r3lightning.data.step_rollout import StepRollout
from r3lightning.rollout.explorers.reflection import Reflector, load_template
from r3lightning.rollout.warmstart import reflection_corpus, scripted_reflection_samples
from r3lightning.types import Trajectory, Turn


@dataclass
class TaskBatch:
    """The tasks of one training step on this rank. step: the global batch index (cursor; -1 for
    validation). val_samples: sampled episodes per task of a validation batch (``data.val_samples``)."""

    step: int
    tasks: list[Task]
    val_samples: int = 1


def _identity(batch):
    return batch


class TaskStream(IterableDataset):
    """Endless stream of TaskBatch for one rank, starting at ``start_step``.

    Step ``s`` on rank ``r`` of ``W`` takes task indices ``(s*W + r)*n ... (s*W + r)*n + n-1``: ranks
    never share a task and the stream is independent of how many batches were prefetched.
    """

    def __init__(self, suite: TaskSuite, tasks_per_step: int, start_step: int, rank: int, world_size: int) -> None:
        self.suite, self.tasks_per_step = suite, tasks_per_step
        self.start_step, self.rank, self.world_size = start_step, rank, world_size

    def __iter__(self) -> Iterator[TaskBatch]:
        step = self.start_step
        while True:
            first = (step * self.world_size + self.rank) * self.tasks_per_step
            yield TaskBatch(step, [self.suite.train_task(first + j) for j in range(self.tasks_per_step)])
            step += 1


@dataclass
class DemoConfig:
    """SFT warm-start data.

    Args:
        source: ``suite`` (the environment's scripted expert, ``TaskSuite.demonstration``) or the path of
            a JSONL file whose rows hold ``messages``: a chat conversation (system/user/assistant).
        reflections: also train on the suite's scripted reflections and guided retries (R³L
            warm-start: needs a suite with ``diagnose``/``expert_continuation`` and an explorer that
            reflects, whose prompt templates are used).
        tasks_per_step: demonstrations per warm-start step on each rank (0: ``data.tasks_per_step``).
            SFT steps cost no generation, so they can afford larger batches than RL steps.
        reflection_tasks_per_step: with ``reflections``, how many of a step's demonstration tasks also
            give a reflect and a retry sample (0: all). Reflections are long JSON answers after long
            prompts; fewer of them keeps the step cheap and leaves the action tokens most of the loss.
        success_reflection_share: with ``reflections``, the share of reflection tasks played by the
            expert without a mistake, whose reflection judges ``success`` (no retry). Every other
            reflection sample has an injected mistake, so at 0 the policy never learns to call an
            episode a success: R³L then retries every episode and ``train_success_judgments`` has
            nothing to train. It also changes when a tiny policy learns to act on the goal during the
            warm-start, so a recipe can teach it late (``success_reflection_from_step``). The runs
            behind the recipes' shares: benchmarks/results/NOTEBOOK.md.
        success_reflection_from_step: the warm-start step from which ``success_reflection_share``
            applies (0: from the first). The steps before it play no clean episode and are exactly a
            share-0 run's steps (the same random stream), so the policy learns to act first and to
            judge success after.
        alternative_guidance_share: with ``reflections``, the share of guided-retry samples whose
            guidance names a random other admissible action at the pivot instead of the expert's, the
            retry taking it and the expert continuing after it. The expert's own suggestion names the
            action the observation already implies, so the policy can fit every retry sample without
            reading the guidance, and then ignores it (measured: benchmarks/results/NOTEBOOK.md, "The
            oracle arm" and "The guidance probe"). Logged
            per warm-start step: ``warmstart/alternative_guidance_samples`` and, for draws that fell
            back to the expert's suggestion, ``warmstart/alternative_guidance_unavailable``. 0 keeps
            the expert's suggestion everywhere.
    """

    source: str = "suite"
    reflections: bool = False
    tasks_per_step: int = 0
    reflection_tasks_per_step: int = 0
    success_reflection_share: float = 0.0
    success_reflection_from_step: int = 0
    alternative_guidance_share: float = 0.0

    def __post_init__(self) -> None:
        for name in ("success_reflection_share", "alternative_guidance_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"data.demos.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.success_reflection_from_step < 0:
            raise ValueError(f"data.demos.success_reflection_from_step must be >= 0, got {self.success_reflection_from_step}")

    def check_warmup(self, sft_warmup_steps: int) -> None:
        """Refuse success reflections that would start after a warm-start of ``sft_warmup_steps``
        steps: they would never be played."""
        if self.reflections and self.success_reflection_share > 0 and self.success_reflection_from_step >= sft_warmup_steps:
            raise ValueError(
                f"data.demos.success_reflection_from_step ({self.success_reflection_from_step}) >= "
                f"model.phases.sft_warmup_steps ({sft_warmup_steps}): no warm-start step would play a clean "
                "success episode; start it earlier or set data.demos.success_reflection_share to 0"
            )

    def success_share_at(self, step: int) -> float:
        """The share of clean success episodes among the reflection tasks of warm-start ``step``."""
        return self.success_reflection_share if step >= self.success_reflection_from_step else 0.0


class RolloutDataModule(L.LightningDataModule):
    """Streams tasks and turns them into experience with the current policy.

    Args:
        suite: tasks and their environment (``class_path`` of a TaskSuite, e.g.
            ``r3lightning.envs.math_env.MathSuite``).
        explorer: how groups are explored (``SampleExplorer`` for GRPO-family methods,
            ``ReflectRetryExplorer`` for R³L, ...).
        group_size: rollout budget per task (N in the papers).
        tasks_per_step: tasks per optimizer step on each rank.
        sampling: sampling parameters for training rollouts.
        val_sampling: sampling parameters of validation episodes; the greedy pass uses them with
            temperature 0. Null (default): ``sampling``'s token budget, top_p and stop strings at
            temperature 1, so validation answers get the room training answers get.
        agent: how episodes are played (action format, context limit, step timeout...).
        demos: where SFT warm-start demonstrations come from.
        val_tasks_per_batch: validation tasks per batch.
        val_samples: sampled validation episodes per task (n), at ``val_sampling``; validation logs
            pass@k (unbiased estimator) for k = 1, 2, 4, ... up to n and mean@n beside greedy pass@1.
        seed: base seed of rollout sampling; step ``s`` on rank ``r`` samples with a seed derived from
            (seed, s, r), so resumed and multi-rank runs sample reproducibly. Null (default): the run's
            ``seed_everything`` (``r3l`` fills it in, so ``--seed_everything N`` varies the sampling), or 0
            where nothing gives one.
        max_reward: the reward of a full success, the one value every part reads: explorers (which
            samples are solved and get no reflection or critique, the meta-task rule), the objective
            (positive amplification, ``raft``'s filter) and the success metrics.
        replay: R³'s cross-context replay (``ReplayConfig``): a buffer of past trajectories per task,
            injected into groups whose rewards agree. The buffer is kept (and checkpointed) whenever
            replay is on or the explorer reads past attempts.
    """

    def __init__(
        self,
        suite: TaskSuite,
        explorer: Optional[Explorer] = None,
        group_size: int = 8,
        tasks_per_step: int = 4,
        sampling: SamplingParams = SamplingParams(),
        val_sampling: Optional[SamplingParams] = None,
        agent: AgentLoopConfig = AgentLoopConfig(),
        demos: DemoConfig = DemoConfig(),
        val_tasks_per_batch: int = 32,
        val_samples: int = 1,
        seed: Optional[int] = None,
        max_reward: float = 1.0,
        replay: ReplayConfig = ReplayConfig(),
    ) -> None:
        super().__init__()
        if group_size < 1 or tasks_per_step < 1:
            raise ValueError(f"data: group_size ({group_size}) and tasks_per_step ({tasks_per_step}) must be >= 1")
        if val_samples < 1 or val_tasks_per_batch < 1:
            raise ValueError(f"data: val_samples ({val_samples}) and val_tasks_per_batch ({val_tasks_per_batch}) must be >= 1")
        check_suite(suite)
        self.suite = suite
        self.explorer = explorer if explorer is not None else SampleExplorer()
        self.group_size = group_size
        self.tasks_per_step = tasks_per_step
        # Copies: dataclass defaults in a signature are shared between instances.
        self.sampling = dataclasses.replace(sampling)
        self.val_sampling = dataclasses.replace(sampling, temperature=1.0) if val_sampling is None else dataclasses.replace(val_sampling)
        self.agent = resolve_action_format(suite, agent)  # a copy; refuses a format the suite does not read
        self.demos = dataclasses.replace(demos)
        self.val_tasks_per_batch = val_tasks_per_batch
        self.val_samples = val_samples
        self.seed = 0 if seed is None else seed
        self.max_reward = max_reward
        self.cursor = 0
        self._demo_rows: Optional[list[list[dict]]] = None
        self.loop: Optional[AgentLoop] = None
        self.tokenizer = None
        self.replay = dataclasses.replace(replay)
        keeps_history = self.replay.enabled or self.explorer.traits.uses_history
        self.buffer = ReplayBuffer(self.replay.max_per_task, self.replay.max_total) if keeps_history else None

    def setup(self, stage: str) -> None:
        # A demonstration file is read now, so a bad row stops the run before any training.
        if self.demos.source != "suite" and self._demo_rows is None:
            self._demo_rows = load_chat_jsonl(self.demos.source)

    # ---- task streams -------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        stream = TaskStream(self.suite, self.tasks_per_step, self.cursor, rank, world)
        return DataLoader(stream, batch_size=None, collate_fn=_identity, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        tasks = self.suite.val_tasks()[rank::world]
        if not tasks:
            raise ValueError("data.suite produced no validation tasks for this rank; raise num_val_tasks")
        n = self.val_tasks_per_batch
        batches = [TaskBatch(-1, tasks[i : i + n], self.val_samples) for i in range(0, len(tasks), n)]
        return DataLoader(batches, batch_size=None, collate_fn=_identity, num_workers=0)

    def state_dict(self) -> dict:
        state = {"cursor": self.cursor}
        if hasattr(self.explorer, "state_dict"):
            state["explorer"] = self.explorer.state_dict()
        if self.buffer is not None:
            state["replay_buffer"] = self.buffer.state_dict()
        return state

    @staticmethod
    def check_state_dict(state: object) -> None:
        """ValueError ``"<field>: <problem>"`` when ``state`` is not a ``state_dict`` this module can load
        (``r3lightning.training.checkpoint_state`` names the checkpoint)."""
        if not isinstance(state, dict):
            raise ValueError(f"state: a {type(state).__name__} where a dict was expected")
        if "cursor" not in state:
            raise ValueError("cursor: missing (the task stream's position)")
        expect_int(state["cursor"], "cursor")
        if "replay_buffer" in state:
            try:
                check_replay_state(state["replay_buffer"])
            except ValueError as err:
                raise ValueError(f"replay_buffer.{err}") from None

    def load_state_dict(self, state: dict) -> None:
        self.check_state_dict(state)
        self.cursor = int(state["cursor"])
        if "explorer" in state and hasattr(self.explorer, "load_state_dict"):
            self.explorer.load_state_dict(state["explorer"])
        if self.buffer is not None and "replay_buffer" in state:
            self.buffer.load_state_dict(state["replay_buffer"])

    def tokenizer_corpus(self) -> list[str]:
        """Texts an in-memory tokenizer is trained on: the suite's, plus the reflection vocabulary
        (prompt templates, example reflections) when the explorer reflects or the suite has a
        diagnostician. It does not otherwise depend on the explorer, so one warm-start checkpoint
        serves every method on a suite."""
        texts = corpus_from_suite(self.suite, self.agent)
        if hasattr(self.explorer, "reflector") or has_diagnostician(self.suite):
            texts += reflection_corpus(self.suite, self.reflector, step_timeout_s=self.agent.step_timeout_s)
        return texts

    @property
    def reflector(self) -> Reflector:
        """The explorer's reflector, or one with the built-in templates for explorers without one
        (scripted reflection warm-start data, the tokenizer corpus)."""
        own = getattr(self.explorer, "reflector", None)
        if own is not None:
            return own
        return Reflector.with_builtin_templates()

    # ---- experience ---------------------------------------------------------------------------
    def connect(self, engine: RolloutEngine, tokenizer, objective: AlgorithmConfig) -> None:
        """Bind the engine and tokenizer every rollout uses (once, when the module has built them), and
        refuse an ``objective`` this datamodule's explorer and sampling would leave inert or undefined."""
        self.check_objective(objective)
        self.tokenizer = tokenizer
        self.loop = AgentLoop(self.suite, engine, tokenizer, self.agent)
        self.check_prompt_room()

    def check_objective(self, objective: AlgorithmConfig) -> None:
        """The explorer × objective pairing (``check_combination``: errors raised, doubtful pairs warned)
        and R³'s ranking window against the answer budget."""
        for warning in check_combination(objective, self.explorer, self.demos.reflections):
            rank_zero_warn(warning)
        ranking = objective.ranking
        if ranking.enabled and 2 * ranking.window > self.sampling.max_new_tokens:
            raise ValueError(
                f"model.algorithm.ranking.window ({ranking.window}) cannot make two windows within "
                f"data.sampling.max_new_tokens ({self.sampling.max_new_tokens}): the stability score would be "
                f"undefined for every response; set the window to at most {self.sampling.max_new_tokens // 2}"
            )

    def check_prompt_room(self, num_tasks: int = 8) -> None:
        """Refuse a context that cannot hold a task's first prompt (with what the explorer adds to it)
        and a full answer: every such episode would end before its first token, silently.

        Checked on the first ``num_tasks`` training and validation tasks, from their ``Task.prompt``
        (the first user message). The explorer's addition counts its generated parts (a past answer,
        a reflection, a critique) at their full generation budget.
        """
        loop = self.connected_loop
        limit = self.agent.max_context_tokens
        tasks = [t for t in [self.suite.train_task(i) for i in range(num_tasks)] + self.suite.val_tasks()[:num_tasks] if t.prompt]
        if not tasks:
            return
        answer = max(self.sampling.max_new_tokens, self.val_sampling.max_new_tokens)
        prompt, longest = max(((len(loop.chat.first_prompt(t.prompt)), t) for t in tasks), key=lambda pair: pair[0])
        if prompt + answer > limit:
            raise ValueError(
                f"data.agent.max_context_tokens ({limit}) cannot hold task {longest.task_id!r}'s prompt ({prompt} tokens) "
                f"and an answer of data.sampling / data.val_sampling max_new_tokens ({answer}): raise "
                f"data.agent.max_context_tokens to at least {prompt + answer}"
            )
        budget_of = getattr(self.explorer, "guidance_budget", None)
        budget = budget_of(self.sampling, self.longest_feedback()) if budget_of is not None else None
        if budget is None:
            return
        guided = max(
            len(loop.chat.first_prompt(self.agent.guidance_template.format(observation=t.prompt, guidance=budget.text)))
            for t in tasks
        )
        need = guided + budget.generated_tokens + self.sampling.max_new_tokens
        if need > limit:
            raise ValueError(
                f"data.explorer ({type(self.explorer).__name__}) shows guidance with the prompt: {guided} tokens of "
                f"prompt and template, up to {budget.generated_tokens} generated tokens inside it and "
                f"data.sampling.max_new_tokens ({self.sampling.max_new_tokens}) for the answer need {need}, more than "
                f"data.agent.max_context_tokens ({limit}); its episodes would end before their first token. Raise "
                f"data.agent.max_context_tokens to at least {need} (or shorten the explorer's generation budget)"
            )

    def longest_feedback(self) -> str:
        """The suite's longest feedback after a failed answer, in tokens (``TaskSuite.feedback_texts``; ""
        when it declares none): what a past attempt shown in context carries at most."""
        tokenizer = self.connected_loop.tokenizer
        return max(self.suite.feedback_texts(), key=lambda text: len(tokenizer.encode(text, add_special_tokens=False)), default="")

    @property
    def connected_loop(self) -> AgentLoop:
        if self.loop is None:
            raise RuntimeError("RolloutDataModule.connect(engine, tokenizer, objective) must be called before rollouts")
        return self.loop

    @property
    def scoring_temperature(self) -> float:
        """The temperature training rollouts were sampled at, under which the trainer scores them
        (greedy rollouts are scored at 1)."""
        return self.sampling.temperature if self.sampling.temperature > 0 else 1.0

    def rollout_seed(self, step: int) -> int:
        rank, _ = self._rank_world()
        return (self.seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**31 - 1)

    def rollout(self, batch: TaskBatch, phase: str) -> StepRollout:
        """The samples of one training step: demonstrations (``phase == "sft"``, all for the SFT head)
        or the explorer's groups (``"rl"``), made with the engine's current weights, with how the
        objective scores them. Marks the batch consumed (the checkpointed cursor)."""
        self.cursor = batch.step + 1
        if phase == "sft":
            loop = self.connected_loop if self.demos.source == "suite" else None
            failures = loop.env_calls.failures if loop is not None else 0
            counts: collections.Counter = collections.Counter()
            demos = self.demonstrations(batch, counts)
            # Scripted retry samples whose prefix the environment could not replay are dropped, and counted.
            kept = [d for d in demos if d.end_reason != "replay_failed"]
            metrics = {"warmstart/replay_failures": float(len(demos) - len(kept))}
            if self.demos.alternative_guidance_share > 0:
                metrics["warmstart/alternative_guidance_samples"] = float(counts["alternative_guidance"])
                metrics["warmstart/alternative_guidance_unavailable"] = float(counts["alternative_unavailable"])
            if loop is not None:
                metrics["warmstart/env_call_errors"] = float(loop.env_calls.failures - failures)
            return self.scored(Exploration(groups=[], sft=kept, metrics=metrics))
        seed = self.rollout_seed(batch.step)
        spec = ExplorationSpec(self.group_size, self.sampling, self.max_reward, self.buffer, random.Random(seed))
        loop = self.connected_loop
        before = loop.generated_tokens
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            exploration = self.explorer.explore(batch.tasks, loop, spec)
        # Everything the step generated: episodes, and the reflections, critiques and retries that
        # reflection methods add (what a method spends, to compare methods at equal cost).
        exploration.metrics["rollout/generated_tokens"] = float(loop.generated_tokens - before)
        if self.replay.enabled:
            figures = replay_into_groups(
                exploration.groups, self.buffer, self.replay, batch.step, self.max_reward, random.Random(seed + 1), loop.rerender
            )
            exploration.metrics.update(figures)
        elif self.buffer is not None:
            record_step(exploration.groups, self.buffer, batch.step)
        return self.scored(exploration)

    def scored(self, exploration: Exploration) -> StepRollout:
        """``exploration`` with the reward scale, sampling temperature and replay behaviour it is scored with."""
        return StepRollout(exploration, self.max_reward, self.scoring_temperature, self.replay.behaviour)

    def evaluate(self, tasks: list[Task], greedy: bool, samples: int = 1) -> list[Trajectory]:
        """``samples`` validation episodes per task (task-major: task 0's, then task 1's...), greedy or
        sampled at ``val_sampling``. Every call samples under the same seed (from ``data.seed``), so a
        validation batch gives the same episodes whenever it is run with the same weights."""
        params = SamplingParams(
            temperature=0.0 if greedy else self.val_sampling.temperature,
            top_p=self.val_sampling.top_p,
            max_new_tokens=self.val_sampling.max_new_tokens,
            stop=list(self.val_sampling.stop),
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + 17)
            return self.connected_loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(samples)], params)

    # ---- demonstrations (SFT warm-start) ------------------------------------------------------
    def demonstrations(self, batch: TaskBatch, counts: Optional[collections.Counter] = None) -> list[Trajectory]:
        """Demonstration trajectories (origin ``demo``) for the SFT warm-start phase; ``counts`` gets the
        scripted reflection data's alternative-guidance tallies (``scripted_reflection_samples``)."""
        if self.demos.source == "suite":
            return self._suite_demonstrations(batch, self.connected_loop, counts)
        return self._file_demonstrations(batch, self.tokenizer)

    def _demo_tasks(self, batch: TaskBatch) -> list[Task]:
        n = self.demos.tasks_per_step
        if n <= 0 or n == len(batch.tasks):
            return batch.tasks
        rank, world = self._rank_world()
        first = (batch.step * world + rank) * n
        return [self.suite.train_task(first + j) for j in range(n)]

    def _suite_demonstrations(self, batch: TaskBatch, loop: AgentLoop, counts: Optional[collections.Counter] = None) -> list[Trajectory]:
        tasks = self._demo_tasks(batch)
        actions = [self.suite.demonstration(task) for task in tasks]
        missing = [t.task_id for t, a in zip(tasks, actions) if not a]
        if missing:
            raise ValueError(
                f"data.demos.source=suite: {type(self.suite).__name__} has no demonstration for task {missing[0]!r}; "
                "give a JSONL file of demonstrations instead"
            )
        demos = loop.play_actions([EpisodeRequest(task=t, origin="demo") for t in tasks], actions)
        if self.demos.reflections:
            rng = random.Random(self.rollout_seed(batch.step))
            n = self.demos.reflection_tasks_per_step
            chosen = tasks[:n] if n > 0 else tasks
            demos += scripted_reflection_samples(
                loop, self.reflector, chosen, rng, self.demos.success_share_at(batch.step), self.demos.alternative_guidance_share, counts
            )
        return demos

    def _file_demonstrations(self, batch: TaskBatch, tokenizer) -> list[Trajectory]:
        if self._demo_rows is None:
            self._demo_rows = load_chat_jsonl(self.demos.source)
        rows = self._demo_rows
        rank, world = self._rank_world()
        n = self.demos.tasks_per_step if self.demos.tasks_per_step > 0 else self.tasks_per_step
        start = (batch.step * world + rank) * n
        return [
            conversation_trajectory(rows[(start + j) % len(rows)], tokenizer, f"demo-{(start + j) % len(rows)}")
            for j in range(n)
        ]


def load_chat_jsonl(path: str) -> list[list[dict]]:
    """Rows of ``{"messages": [{"role", "content"}, ...]}``; errors name the file, row and field."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.demos.source: no such file {path!r}")
    rows = []
    for number, row in numbered_jsonl_rows(path):
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{path}, row {number}: field 'messages' (a non-empty list) is missing")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise ValueError(f"{path}, row {number}: field 'messages' has an entry without a valid role/content")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{path}, row {number}: field 'messages' has no assistant message to train on")
        check_role_order([m["role"] for m in messages], f"{path}, row {number}")
        rows.append(messages)
    if not rows:
        raise ValueError(f"data.demos.source: {path!r} has no rows")
    return rows


def check_role_order(roles: list[str], where: str) -> None:
    """An optional system message first, then user and assistant messages alternating, starting with a
    user message (two user messages in a row would silently lose the first)."""
    body = roles[1:] if roles[:1] == ["system"] else roles
    for position, role in enumerate(body):
        expected = "user" if position % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(
                f"{where}: message {position + 1 + (len(roles) - len(body))} is {role!r} where {expected!r} was expected "
                "(messages: an optional system message, then user and assistant alternating)"
            )


def conversation_trajectory(messages: list[dict], tokenizer, task_id: str, origin: str = "demo") -> Trajectory:
    """Tokenize a finished chat conversation into turns, incrementally (same scheme as the agent loop)."""
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    chat = ChatFormatter(tokenizer, system_prompt=system)
    turns: list[Turn] = []
    pending: Optional[list[int]] = None
    for m in messages:
        if m["role"] == "system":
            continue
        if m["role"] == "user":
            text = m["content"]
            pending = chat.first_prompt(text) if not turns else chat.next_user_turn(text, previous_ended_with_eos=True)
        else:
            if pending is None:
                raise ValueError(f"demonstration {task_id}: an assistant message must follow a user message")
            ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            turns.append(Turn(context_ids=pending, response_ids=ids, action=m["content"]))
            pending = None
    return Trajectory(task_id=task_id, turns=turns, reward=1.0, success=True, origin=origin)


def corpus_from_suite(suite: TaskSuite, agent: AgentLoopConfig, num_tasks: int = 64) -> list[str]:
    """Texts a tiny tokenizer should compress well: system prompt, observations, feedback and
    rendered expert actions of the first ``num_tasks`` training and validation tasks, and the texts the
    framework adds to prompts whatever the method (the format feedback, the guidance block and R³'s
    in-context template), so a prompt with guidance costs words, not characters, and one warm-start
    serves every method. Capping the validation tasks keeps the tokenizer (and so checkpoints) the same
    when only the size of the validation set changes."""
    check_suite(suite)
    agent = resolve_action_format(suite, agent)
    # The environment calls get the agent loop's deadline and checks; one that fails stops the run with a
    # line naming it (skipping it would make the tokenizer, and so the checkpoints, depend on a fault).
    calls = SuiteCalls(suite, agent.step_timeout_s, "data.suite: building the tokenizer's corpus")
    texts = [
        suite.system_prompt,
        INVALID_FORMAT_FEEDBACK,
        agent.guidance_template.format(observation="", guidance=""),
        load_template("", "in_context.txt").format(attempt="Feedback:"),
    ]
    tasks = [suite.train_task(i) for i in range(num_tasks)] + suite.val_tasks()[:num_tasks]
    for task in tasks:
        env = suite.make_env()
        texts.append(calls.reset(env, task))
        for action in suite.demonstration(task) or []:
            texts.append(render_action(action, agent))
            result = calls.step(env, task, action)
            texts.extend([result.observation, result.feedback])
            if result.done:
                break
    return texts


def has_diagnostician(suite: TaskSuite) -> bool:
    """Whether ``suite`` overrides ``TaskSuite.diagnose`` (procedural worlds write scripted reflections)."""
    return type(suite).diagnose is not TaskSuite.diagnose
