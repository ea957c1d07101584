"""The LightningDataModule: a stream of task batches, and the rollouts made from them.

Lightning prefetches one batch from iterable datasets. Rollouts made in the dataset would therefore
be generated with weights one update old. Here the dataset yields only *tasks* (a pure function of
their index, so prefetching is harmless) and the module calls ``rollout`` inside ``training_step``:
rollout *k* always uses the weights after update *k-1*. The cursor counts *consumed* batches, so a
checkpoint taken mid-run resumes at exactly the next unseen batch.

The module uses the datamodule through four methods: ``connect`` (once: the engine and tokenizer
every rollout uses, the objective, whose pairing with the explorer is checked there, the
warm-start's demonstrations and the first step of ReflectRL's direct tasks), ``rollout(batch)`` (each
RL step: a ``StepRollout``, the exploration with everything the objective reads from the data side),
``demonstrations(batch)`` (each warm-start step: the ``Demonstrations`` producer's samples,
``data/demonstrations.py``) and ``evaluate`` (validation episodes). ReflectRL's distillation phase
also reads ``validation_tasks`` and ``teacher_contexts``.
"""

from __future__ import annotations

import dataclasses
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.envs.base import Task, TaskSuite
from r3lightning.rollout.agent_loop import (
    INVALID_FORMAT_FEEDBACK,
    AgentLoop,
    AgentLoopConfig,
    EpisodeRequest,
    render_action,
    resolve_action_format,
)
from r3lightning.data.state_checks import expect_int
from r3lightning.rollout.env_calls import SuiteCalls, check_suite
from r3lightning.engines.base import RolloutEngine, SamplingParams
from r3lightning.rollout.explorers.base import Exploration, ExplorationSpec, Explorer, SampleExplorer
from r3lightning.data.combinations import check_combination
from r3lightning.data.demonstrations import DemoConfig, Demonstrations
from r3lightning.data.replay import ReplayBuffer, ReplayConfig, check_replay_state, record_step, replay_into_groups
from r3lightning.data.step_rollout import StepRollout
from r3lightning.rollout.explorers.reflection import Reflector, load_template
from r3lightning.rollout.warmstart import reflection_corpus
from r3lightning.types import Trajectory


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
        self.val_tasks_per_batch = val_tasks_per_batch
        self.val_samples = val_samples
        self.seed = 0 if seed is None else seed
        self.max_reward = max_reward
        self.cursor = 0
        self.loop: Optional[AgentLoop] = None
        self.demonstration_source: Optional[Demonstrations] = None
        self.tokenizer = None
        self.replay = dataclasses.replace(replay)
        keeps_history = self.replay.enabled or self.explorer.traits.uses_history
        self.buffer = ReplayBuffer(self.replay.max_per_task, self.replay.max_total) if keeps_history else None

    # ---- task streams -------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        stream = TaskStream(self.suite, self.tasks_per_step, self.cursor, rank, world)
        return DataLoader(stream, batch_size=None, collate_fn=_identity, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        tasks = self.validation_tasks()
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

    def context_budget(self) -> int:
        """The longest prompt plus completion this run asks an engine for, in tokens: twice the episode
        context (``agent.max_context_tokens``; a reflection or critique prompt shows a whole episode)
        plus the longest generation (rollouts, validation, reflections, critiques)."""
        reflector = getattr(self.explorer, "reflector", None)
        generations = [
            self.sampling.max_new_tokens,
            self.val_sampling.max_new_tokens,
            getattr(reflector, "max_tokens", 0),
            getattr(self.explorer, "max_critique_tokens", 0),
        ]
        return 2 * self.agent.max_context_tokens + max(generations)

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
    def connect(
        self,
        engine: RolloutEngine,
        tokenizer,
        objective: AlgorithmConfig,
        demos: Optional[DemoConfig] = None,
        direct_from_step: Optional[int] = None,
    ) -> None:
        """Bind the engine and tokenizer every rollout uses (once, when the module has built them) and the
        warm-start's ``demos`` (None: the schedule has no warm-start), and refuse an ``objective`` this
        datamodule's explorer and sampling would leave inert or undefined.

        ``direct_from_step``: the first step whose training tasks are a ``ReflectiveSuite``'s direct ones
        (ReflectRL's distillation phase; None: none). Set here, after an in-memory tokenizer was trained
        on the suite's first tasks (so it does not depend on that step) and before the task stream
        starts: whether a task is direct is a pure function of its index, so the one-batch prefetch and
        exact resume need nothing more."""
        self.check_objective(objective, demos is not None and demos.reflections)
        self.tokenizer = tokenizer
        self.loop = AgentLoop(self.suite, engine, tokenizer, self.agent)
        self.check_prompt_room()
        self.demonstration_source = None if demos is None else Demonstrations(
            demos, self.suite, self.loop if demos.source == "suite" else None, self.reflector, tokenizer, self.tasks_per_step
        )
        if direct_from_step is not None:
            if not hasattr(self.suite, "direct_from_index") or not hasattr(self.suite, "show_gnt_in_validation"):
                raise ValueError(
                    "model.phases.distill needs data.suite: r3lightning.envs.reflective.ReflectiveSuite "
                    f"(got {type(self.suite).__name__})"
                )
            # Task indices of step s on rank r: (s * world + r) * tasks_per_step + j (TaskStream).
            _, world = self._rank_world()
            self.suite.direct_from_index = direct_from_step * world * self.tasks_per_step

    def check_objective(self, objective: AlgorithmConfig, demo_reflections: bool = False) -> None:
        """The explorer × objective pairing (``check_combination``: errors raised, doubtful pairs warned;
        ``demo_reflections``: the warm-start trains scripted reflections) and R³'s ranking window against
        the answer budget."""
        for warning in check_combination(objective, self.explorer, demo_reflections):
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
        a reflection, a critique) at their full generation budget, and a past attempt's feedback as the
        suite's longest (``longest_feedback``).

        The context is refused when it is too small for the data: when more than half of the checked
        tasks lack room for their prompt and an answer. An outlier row is not: a prompt that alone
        exceeds the context is warned about by name (``AgentLoop.warn_prompt_too_long``, the same one
        warning a row gets wherever the shuffle puts it) and skipped by every rollout that draws it.
        """
        loop = self.connected_loop
        limit = self.agent.max_context_tokens
        tasks = [t for t in [self.suite.train_task(i) for i in range(num_tasks)] + self.suite.val_tasks()[:num_tasks] if t.prompt]
        if not tasks:
            return
        answer = max(self.sampling.max_new_tokens, self.val_sampling.max_new_tokens)
        sizes = [(len(loop.chat.first_prompt(t.prompt)), t) for t in tasks]
        short = [(n, t) for n, t in sizes if n + answer > limit]
        if 2 * len(short) <= len(sizes):  # outliers: skipped where they fall, warned by name
            for n, t in short:
                if n >= limit:
                    loop.warn_prompt_too_long(t.task_id, n)
            sizes = [(n, t) for n, t in sizes if n + answer <= limit]
            tasks = [t for _, t in sizes]
        prompt, longest = max(sizes, key=lambda pair: pair[0])
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

    def rollout(self, batch: TaskBatch) -> StepRollout:
        """The samples of one RL step: the explorer's groups (and what it adds: meta-task SFT samples,
        metrics), made with the engine's current weights, with how the objective scores them. Marks the
        batch consumed (the checkpointed cursor)."""
        self.cursor = batch.step + 1
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
        return self.scored(exploration, seed)

    def demonstrations(self, batch: TaskBatch) -> StepRollout:
        """The samples of one warm-start step: the demonstrations ``connect`` was given, all for the SFT
        head (``Demonstrations.samples``). Marks the batch consumed (the checkpointed cursor)."""
        if self.demonstration_source is None:
            raise RuntimeError("RolloutDataModule.connect(..., demos) must be given the warm-start's demonstrations")
        self.cursor = batch.step + 1
        rank, world = self._rank_world()
        seed = self.rollout_seed(batch.step)
        samples = self.demonstration_source.samples(batch.step, batch.tasks, rank, world, seed)
        return self.scored(samples, seed)

    def scored(self, exploration: Exploration, seed: int) -> StepRollout:
        """``exploration`` with the reward scale, sampling temperature and replay behaviour it is scored
        with, and the step's rollout ``seed``."""
        return StepRollout(exploration, self.max_reward, self.scoring_temperature, self.replay.behaviour, seed)

    def validation_tasks(self, with_golden_negative: bool = False) -> list[Task]:
        """This rank's validation tasks (``with_golden_negative``: only those a ``ReflectiveSuite`` shows with
        a golden negative in the reflective view)."""
        rank, world = self._rank_world()
        tasks = self.suite.val_tasks()
        if with_golden_negative:
            tasks = [t for t in tasks if t.data.get("reflective_prompt")]
        return tasks[rank::world]

    def teacher_contexts(self) -> dict[tuple[int, ...], list[int]]:
        """Context distillation's teacher prompts (a ``ReflectiveSuite``'s ``teacher_prompts``), as token ids
        keyed by the student's: each training question's direct prompt and its reflective prompt, rendered
        the way the rollout renders a first prompt."""
        chat = self.connected_loop.chat
        return {tuple(chat.first_prompt(direct)): chat.first_prompt(reflective) for direct, reflective in self.suite.teacher_prompts().items()}

    @contextmanager
    def _validation_view(self, direct: Optional[bool]) -> Iterator[None]:
        """A ``ReflectiveSuite``'s validation episodes with (``direct`` False) or without (True) the golden
        negative in the prompt; None, or a suite with one view: as it is."""
        shown = getattr(self.suite, "show_gnt_in_validation", None)
        if direct is None or shown is None:
            yield
            return
        self.suite.show_gnt_in_validation = not direct
        try:
            yield
        finally:
            self.suite.show_gnt_in_validation = shown

    def evaluate(self, tasks: list[Task], greedy: bool, samples: int = 1, direct: Optional[bool] = None) -> list[Trajectory]:
        """``samples`` validation episodes per task (task-major: task 0's, then task 1's...), greedy or
        sampled at ``val_sampling``. Every call samples under the same seed (from ``data.seed``), so a
        validation batch gives the same episodes whenever it is run with the same weights. ``direct``:
        a ``ReflectiveSuite``'s questions without (True) or with (False) their golden negative in the
        prompt (ReflectRL's direct and reflective validation); None: the suite's own view."""
        params = SamplingParams(
            temperature=0.0 if greedy else self.val_sampling.temperature,
            top_p=self.val_sampling.top_p,
            top_k=self.val_sampling.top_k,
            min_p=self.val_sampling.min_p,
            max_new_tokens=self.val_sampling.max_new_tokens,
            stop=list(self.val_sampling.stop),
        )
        with torch.random.fork_rng(devices=[]), self._validation_view(direct):
            torch.manual_seed(self.seed + 17)
            return self.connected_loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(samples)], params)


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
