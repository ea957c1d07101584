"""ReflectRL's task views of a suite: reflective (a golden negative in context) and direct (plain).

A *golden negative* (GNT) is an expert's wrong answer to a training question, kept with its full
reasoning (``r3l gnt-pool`` writes them, ``r3lightning.data.reflectrl.gnt_pool``). A *reflective* task shows the
question and that wrong answer and asks for the wrong step, a correction and the final answer; a
*direct* task is the wrapped suite's own question. ``ReflectiveSuite`` serves both:

- training task ``index`` is reflective below ``direct_from_index`` and direct from it on (a question
  the pool's expert answered, or any of the wrapped suite's: ``direct_tasks``), a pure function of the
  index, so Lightning's one-batch prefetch and exact resume need nothing more (``RolloutDataModule.connect``
  sets ``direct_from_index`` from the first step of the distillation phase, ``model.phases.distill``,
  before the stream starts);
- validation tasks are the wrapped suite's, each carrying the GNT the expert wrote for it, if any;
  whether an episode shows it is decided when its environment is made, from
  ``show_gnt_in_validation`` (stage 1: reflective validation; stage 2: direct; the datamodule's
  ``evaluate`` sets it for the episodes it plays).

The reflective prompt is built here only (``reflective_prompt``), so the reflective SFT rows
(``r3lightning.data.reflectrl.reflective_sft``) and the reflective tasks see exactly the same text.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Literal, Optional

from r3lightning.envs.base import Environment, StepResult, Task, TaskSuite
from r3lightning.envs.common import finite_index
from r3lightning.envs.jsonl import numbered_jsonl_rows

DEFAULT_REFLECTIVE_TEMPLATE = (
    "{question}\nA previous answer, which is wrong:\n{attempt}\n"
    "Name the wrong step, correct it and give the final answer in \\boxed{{}}."
)
"""The reflective prompt: ``{question}`` (the task's prompt as the expert saw it) and ``{attempt}`` (the GNT)."""

LABEL_GNT, LABEL_GT_PLUS = "gnt", "gt_plus"
POOL_FIELDS = ("label", "task_id", "split", "question", "prompt", "answer", "response")
"""Fields every row of a GNT pool file has (``r3lightning.data.reflectrl.gnt_pool`` writes them, with provenance)."""


def reflective_prompt(question: str, attempt: str, template: str = DEFAULT_REFLECTIVE_TEMPLATE) -> str:
    """The user message of a reflective task: ``template`` with ``question`` (str, the prompt the expert
    answered) and ``attempt`` (str, its wrong answer, whole) filled in."""
    return template.format(question=question, attempt=attempt.strip())


def read_pool(path: str, dropped: Optional[dict[str, list[str]]] = None) -> list[dict[str, Any]]:
    """Rows of a GNT pool file written by ``r3l gnt-pool`` (list of dicts with ``POOL_FIELDS``).

    Rows whose ``label`` is not ``gnt``/``gt_plus`` or whose ``split`` is not ``train``/``val`` are dropped;
    ``dropped`` (reason -> one message per row, naming file and row) collects them for the caller to
    report. Raises FileNotFoundError naming ``path``; ValueError naming the file when it has no rows,
    and naming the row when one is not a pool row or not UTF-8 (the pool writer only writes valid rows,
    so this means the file was edited or is another file).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GNT pool: no such file {path!r} (write it with `r3l gnt-pool ... --out {path}`)")
    rows = []
    dropped = {} if dropped is None else dropped
    numbered = numbered_jsonl_rows(path)
    if not numbered:
        raise ValueError(f"GNT pool {path!r} has no rows")
    for number, row in numbered:
        missing = [f for f in POOL_FIELDS if not isinstance(row, dict) or f not in row]
        if missing:
            raise ValueError(f"{path}, row {number}: not a GNT pool row (no field {missing[0]!r})")
        if row["label"] not in (LABEL_GNT, LABEL_GT_PLUS):
            dropped.setdefault("unknown_label", []).append(
                f"{path}, row {number}: unknown label {row['label']!r} (not {LABEL_GNT!r} or {LABEL_GT_PLUS!r}); dropped"
            )
        elif row["split"] not in ("train", "val"):
            dropped.setdefault("unknown_split", []).append(f"{path}, row {number}: unknown split {row['split']!r} (not 'train' or 'val'); dropped")
        else:
            rows.append(row)
    return rows


def pool_task(row: dict[str, Any]) -> Task:
    """The direct task a pool row answers (its prompt, reference answer and question)."""
    return Task(task_id=row["task_id"], prompt=row["prompt"], answer=row["answer"], data={"question": row["question"]})


class ReflectiveEnv:
    """The wrapped suite's environment; on a validation task with a GNT, when ``show_gnt``, the first
    observation is the reflective prompt instead of the question. Verification is the wrapped
    environment's (the reference answer is the same)."""

    def __init__(self, inner: Environment, show_gnt: bool) -> None:
        self.inner = inner
        self.show_gnt = show_gnt

    def reset(self, task: Task) -> str:
        observation = self.inner.reset(task)
        reflective = task.data.get("reflective_prompt")
        return reflective if self.show_gnt and reflective else observation

    def step(self, action: str) -> StepResult:
        return self.inner.step(action)


class ReflectiveSuite(TaskSuite):
    """ReflectRL's view of a single-turn suite: reflective tasks (a golden negative in context) for
    stage 1, the suite's own direct tasks for stage 2 (docs/reflectrl.md).

    Args:
        suite: the wrapped single-turn suite (its tasks, environment, verifier and system prompt),
            e.g. ``r3lightning.envs.math_env.MathSuite``.
        pool: path of the GNT pool (``r3l gnt-pool --out``). Its ``gnt`` rows of split ``train`` are the
            reflective training tasks (each pass over them reshuffled); those of split ``val`` are
            shown with their validation question in reflective validation. Read when first needed.
        template: the reflective prompt, with ``{question}`` and ``{attempt}``; ``r3l reflect-sft``
            reads it from the same config, so stage-1 SFT and reflective tasks match.
        direct_from_index: training tasks with this index or higher are direct tasks (``direct_tasks``);
            null: every training task is reflective. With ``model.phases.distill`` the datamodule sets
            it to the phase's first step x world size x ``data.tasks_per_step`` when it is connected,
            after an in-memory tokenizer was trained on the suite's first tasks, so the tokenizer does
            not depend on that step.
        show_gnt_in_validation: validation episodes of questions with a GNT show it (reflective
            validation). With ``model.phases.distill`` the datamodule's ``evaluate`` sets it per
            validation: on in stage 1, off in stage 2.
        seed: seeds the per-pass shuffle of the reflective training tasks (and of the direct ones drawn
            from the pool).
        direct_tasks: where stage 2's direct questions come from. ``pool`` (default): the training
            questions the pool's expert answered (the method's training prompts; each pass over them
            reshuffled), so the context-distillation teacher has a GNT for nearly every one (all but
            those the expert always got right). ``suite``: the wrapped suite's training task of the same
            index (for a generated suite, mostly questions without a GNT).
    """

    def __init__(
        self,
        suite: TaskSuite,
        pool: str,
        template: str = DEFAULT_REFLECTIVE_TEMPLATE,
        direct_from_index: Optional[int] = None,
        show_gnt_in_validation: bool = True,
        seed: int = 0,
        direct_tasks: Literal["pool", "suite"] = "pool",
    ) -> None:
        if suite.max_turns != 1:
            raise ValueError(
                f"ReflectiveSuite: the wrapped suite must be single-turn (max_turns 1), got {suite.max_turns}"
            )
        if direct_tasks not in ("pool", "suite"):
            raise ValueError(f"ReflectiveSuite: direct_tasks must be 'pool' or 'suite', got {direct_tasks!r}")
        if "{question}" not in template or "{attempt}" not in template:
            raise ValueError("ReflectiveSuite: template needs both {question} and {attempt}")
        self.suite = suite
        self.pool = pool
        self.template = template
        self.direct_from_index = direct_from_index
        self.show_gnt_in_validation = show_gnt_in_validation
        self.seed = seed
        self.direct_tasks = direct_tasks
        self.system_prompt = suite.system_prompt
        self.answer_format = suite.answer_format
        self.max_turns = 1
        self._train_gnt: Optional[list[dict[str, Any]]] = None
        self._train_questions: list[dict[str, Any]] = []
        self._val_gnt: dict[str, dict[str, Any]] = {}

    # ---- the pool -----------------------------------------------------------------------------
    def _load(self) -> list[dict[str, Any]]:
        if self._train_gnt is None:
            dropped: dict[str, list[str]] = {}
            rows = read_pool(self.pool, dropped)
            if dropped:
                counts = ", ".join(f"{reason} {len(messages)}" for reason, messages in sorted(dropped.items()))
                warnings.warn(f"ReflectiveSuite: {sum(map(len, dropped.values()))} rows of the pool dropped ({counts}); "
                              f"the first: {next(iter(dropped.values()))[0]}", stacklevel=2)
            train = [r for r in rows if r["label"] == LABEL_GNT and r["split"] == "train"]
            if not train:
                raise ValueError(f"ReflectiveSuite: the pool {self.pool!r} has no GNT rows of split 'train'")
            questions: dict[str, dict[str, Any]] = {}
            for row in rows:  # the first GNT of each validation question; each training question once
                if row["label"] == LABEL_GNT and row["split"] == "val":
                    self._val_gnt.setdefault(row["task_id"], row)
                if row["split"] == "train":
                    questions.setdefault(row["prompt"], row)
            self._train_questions = list(questions.values())
            self._train_gnt = train
        return self._train_gnt

    def teacher_prompts(self) -> dict[str, str]:
        """Context distillation's teacher prompts: the direct prompt (str) of every training question
        with a training GNT -> its reflective prompt (str) with the first of those GNTs in pool order.
        Validation GNTs are never used (the validation questions stay unseen)."""
        prompts: dict[str, str] = {}
        for row in self._load():
            prompts.setdefault(row["prompt"], reflective_prompt(row["prompt"], row["response"], self.template))
        return prompts

    # ---- tasks --------------------------------------------------------------------------------
    def is_direct(self, index: int) -> bool:
        """Whether training task ``index`` is direct (pure function of the index and the config)."""
        return self.direct_from_index is not None and index >= self.direct_from_index

    def train_task(self, index: int) -> Task:
        if index < 0:
            raise IndexError(f"ReflectiveSuite: train_task index must be >= 0, got {index}")
        if self.is_direct(index):
            if self.direct_tasks == "suite":
                return self.suite.train_task(index)
            self._load()
            row = self._train_questions[finite_index(self.seed, index, len(self._train_questions))]
            return pool_task(row)
        rows = self._load()
        number = finite_index(self.seed, index, len(rows))
        return self.reflective_task(rows[number], f"{rows[number]['task_id']}~gnt{number}")

    def reflective_task(self, row: dict[str, Any], task_id: str) -> Task:
        """The reflective task of pool row ``row``: its GNT in the prompt, the same reference answer."""
        return Task(
            task_id=task_id,
            prompt=reflective_prompt(row["prompt"], row["response"], self.template),
            answer=row["answer"],
            data={"question": row["question"], "direct_prompt": row["prompt"], "gnt": row["response"], "reflective": True},
        )

    def val_tasks(self) -> list[Task]:
        self._load()
        tasks = []
        for task in self.suite.val_tasks():
            row = self._val_gnt.get(task.task_id)
            data = dict(task.data)
            if row is not None:
                data.update(reflective_prompt=reflective_prompt(task.prompt, row["response"], self.template), gnt=row["response"])
            tasks.append(Task(task.task_id, task.prompt, task.answer, data))
        return tasks

    @property
    def val_gnt_coverage(self) -> float:
        """Share of validation questions that have a GNT (the others are always shown directly)."""
        tasks = self.suite.val_tasks()
        self._load()
        return sum(t.task_id in self._val_gnt for t in tasks) / max(len(tasks), 1)

    def make_env(self) -> ReflectiveEnv:
        return ReflectiveEnv(self.suite.make_env(), self.show_gnt_in_validation)

    def feedback_texts(self) -> tuple[str, ...]:
        return self.suite.feedback_texts()

    # ---- scripted data --------------------------------------------------------------------------
    def critic(self) -> Optional[Callable[[Task, str], Optional[str]]]:
        """The wrapped suite's scripted critic, ``(direct task, wrong response) -> critique text``, or
        None when it has none. Math suites have one (``envs.math_critic``: arithmetic and
        reasoning-gym expressions); other suites may define ``scripted_critique(task, response)``
        returning the text."""
        return scripted_critic(self.suite)

    def demonstration(self, task: Task) -> Optional[list[str]]:
        """Reflective tasks: the scripted critique of their GNT (None without a critic); direct tasks:
        the wrapped suite's demonstration."""
        if not task.data.get("reflective"):
            return self.suite.demonstration(task)
        critic = self.critic()
        if critic is None:
            return None
        direct = Task(task.task_id, task.data["direct_prompt"], task.answer, {"question": task.data["question"]})
        text = critic(direct, task.data["gnt"])
        return [text] if text else None


def answer_reader(suite: TaskSuite) -> Callable[[str], Optional[str]]:
    """How ``suite`` finds a response's final answer: a math suite's own reader (``final_answer``), else
    ``\\boxed{}`` (``extract_answer``)."""
    from r3lightning.envs.math_env import FINAL_ANSWER_READERS, extract_answer

    return FINAL_ANSWER_READERS.get(getattr(suite, "final_answer", "boxed"), extract_answer)


def scripted_critic(suite: TaskSuite, target: Literal["critique", "solution"] = "critique") -> Optional[Callable[[Task, str], Optional[str]]]:
    """``(task, wrong response) -> reflective target text or None`` for ``suite``, or None when it has no
    critic for ``target``: ``critique`` (wrong step, correction, boxed answer) or ``solution`` (the
    corrected answer in the direct answers' format; math suites only)."""
    from r3lightning.envs.math_env import MathSuite

    if isinstance(suite, MathSuite):
        from r3lightning.envs.math_critic import scripted_critique

        read_answer = answer_reader(suite)

        def math_critic(task: Task, response: str) -> Optional[str]:
            critique = scripted_critique(task, response, read_answer)
            if critique is None:
                return None
            if target == "critique":
                return critique.text
            # A number-only suite's direct answer is the suite's own demonstration (the bare number).
            return critique.solution if suite.final_answer == "boxed" else suite.demonstration(task)[0]

        return math_critic
    if target == "solution":
        return None
    own = getattr(suite, "scripted_critique", None)
    return own if callable(own) else None
