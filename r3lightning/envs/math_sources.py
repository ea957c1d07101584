"""Where math problems come from: files, Hugging Face, CHAMP, reasoning-gym and a built-in generator.

A source yields ``MathItem``s. Finite sources (files, datasets) are lists of items; generators are
functions ``seed -> MathItem``. ``FiniteSplit`` and ``GeneratedSplit`` turn either kind into the
random-access train stream and the fixed validation list that ``MathSuite`` needs.

Heavy optional libraries (reasoning_gym, datasets, pyarrow, champ_dataset) are imported only by the
source that needs them, so the built-in ``arithmetic`` source works with the standard library alone.
"""

from __future__ import annotations

import hashlib
import warnings
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from r3lightning.envs.common import derive_seed, shuffled_range
from r3lightning.envs.jsonl import numbered_jsonl_rows

SCHEMES = ("arithmetic", "reasoning_gym:<generator>", "champ", "jsonl:<path>", "parquet:<path>", "hf:<name>")
"""The ``source`` strings ``MathSuite`` accepts."""

_MAX_REDRAWS = 1000
"""Draws a generator gets to produce a problem that is not a validation problem before we give up."""


@dataclass(frozen=True)
class MathItem:
    """One problem.

    key: stable id within its source (``row17``, ``train/5``).
    question: the problem text, without any answer-format instruction.
    answer: the reference answer.
    solution: a worked solution when the source has one, else None.
    """

    key: str
    question: str
    answer: str
    solution: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# Finite sources


def items_from_rows(
    rows: Iterable[dict[str, Any]],
    origin: str,
    question_field: str,
    answer_field: str,
    solution_field: Optional[str] = None,
) -> list[MathItem]:
    """Validate ``rows`` (dicts) and turn them into items keyed ``row<i>`` (0-based).

    origin: file or dataset name used in error messages.
    Raises ValueError naming ``origin``, the 1-based row number and the field when a required field
    is missing or empty, and when there are no rows at all.
    """
    items = []
    first_row: dict[str, int] = {}
    duplicates: list[int] = []
    for index, row in enumerate(rows):
        question = _required_field(row, question_field, origin, index)
        answer = _required_field(row, answer_field, origin, index)
        solution = None
        if solution_field is not None:
            solution = _required_field(row, solution_field, origin, index)
        if question in first_row:
            # A repeated question would be two identical tasks (and could sit in both splits).
            duplicates.append(index + 1)
            continue
        first_row[question] = index
        items.append(MathItem(key=f"row{index}", question=question, answer=answer, solution=solution))
    if not items:
        raise ValueError(f"{origin}: the dataset is empty")
    if duplicates:
        shown = ", ".join(map(str, duplicates[:5])) + (", ..." if len(duplicates) > 5 else "")
        warnings.warn(f"{origin}: {len(duplicates)} rows repeat an earlier question and were dropped (rows {shown})")
    return items


def _required_field(row: dict[str, Any], field: str, origin: str, index: int) -> str:
    value = row.get(field) if isinstance(row, dict) else None
    if value is None or str(value).strip() == "":
        present = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{origin}: row {index + 1} has no {field!r} field (it has {present})")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        # true, {"v": 1} or [3] would become the strings "True", "{'v': 1}", "[3]" and never verify.
        raise ValueError(
            f"{origin}: row {index + 1}: field {field!r} is {type(value).__name__} ({value!r}); expected text or a number"
        )
    return str(value)


def read_jsonl_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; blank lines are skipped (errors as ``numbered_jsonl_rows``)."""
    return [row for _, row in numbered_jsonl_rows(path)]


def read_parquet_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a parquet file (needs pyarrow). Raises FileNotFoundError naming ``path``."""
    import pyarrow.parquet

    return pyarrow.parquet.read_table(_existing_file(path)).to_pylist()


def _existing_file(path: str) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"math dataset file not found: {path} (resolved to {file.resolve()})")
    return file


def read_hf_rows(name: str, config: Optional[str], split: str) -> list[dict[str, Any]]:
    """Rows of a Hugging Face dataset split; needs network access or a populated HF cache.

    Raises ValueError (chained to the original error; bad input, so ``r3l`` reports it in one line) when
    the dataset cannot be loaded.
    """
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as error:  # offline, unknown name, bad config: all mean "cannot use this source"
        raise ValueError(
            f"could not load Hugging Face dataset {name!r} (config={config!r}, split={split!r}): {' '.join(str(error).split())}. "
            "hf: sources need network access or a cached copy; for offline use export the rows to "
            "a jsonl:/parquet: file."
        ) from error
    return list(dataset)


def champ_items() -> list[MathItem]:
    """The 270 CHAMP competition problems bundled with the ``champ-dataset`` package (offline).

    The package's ``load("v0")`` returns a ``Dataset`` whose ``problems`` map ids (``P_Inequality_3``)
    to ``Problem``s with ``text``, ``answer`` (free-form text, e.g. ``"C(10, 5), or equivalently 252"``)
    and ``solution.steps[*].text``.
    """
    import champ_dataset

    problems = champ_dataset.load("v0").problems
    items = []
    for identifier in sorted(problems):
        problem = problems[identifier]
        steps = problem.solution.steps if problem.solution and problem.solution.steps else []
        solution = "\n".join(step.text for step in steps) or None
        items.append(MathItem(key=identifier, question=problem.text, answer=problem.answer, solution=solution))
    return items


# ---------------------------------------------------------------------------------------------
# Generators


class ArithmeticGenerator:
    """Integer problems like ``Compute 7+12.`` -> ``19`` (or ``Compute 7+3-2.`` with ``terms: 3``), pure
    Python and instant. The solution is the step-wise derivation, one ``a op b = c`` line per operation
    from left to right (``7+3=10`` / ``10-2=8``), so a wrong answer written that way has a wrong step.

    max_operand: operands are drawn uniformly from 0..max_operand.
    operators: string of operators to draw from, a subset of ``"+-*"`` (``"+-"`` only when ``terms`` > 2:
        left-to-right steps are the evaluation order only without precedence).
    nonnegative: order subtraction operands so results are never negative (with ``terms`` > 2, a
        later ``-`` whose operand exceeds the running value becomes ``+``).
    terms: operands per problem, >= 2.
    """

    def __init__(self, max_operand: int = 20, operators: str = "+-", nonnegative: bool = True, terms: int = 2) -> None:
        if max_operand < 1:
            raise ValueError(f"arithmetic: max_operand must be >= 1, got {max_operand}")
        if not operators or set(operators) - set("+-*"):
            raise ValueError(f"arithmetic: operators must be a non-empty subset of '+-*', got {operators!r}")
        if terms < 2:
            raise ValueError(f"arithmetic: terms must be >= 2, got {terms}")
        if terms > 2 and "*" in operators:
            raise ValueError(f"arithmetic: terms {terms} > 2 takes operators from '+-' only, got {operators!r}")
        self.max_operand = max_operand
        self.operators = operators
        self.nonnegative = nonnegative
        self.terms = terms

    def __call__(self, seed: int) -> MathItem:
        rng = random.Random(seed)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.operators)
        if op == "-" and self.nonnegative and a < b:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        expression, steps = f"{a}{op}{b}", [f"{a}{op}{b}={value}"]
        for _ in range(self.terms - 2):
            operand, op = rng.randint(0, self.max_operand), rng.choice(self.operators)
            if op == "-" and self.nonnegative and operand > value:
                op = "+"
            result = value + operand if op == "+" else value - operand
            expression += f"{op}{operand}"
            steps.append(f"{value}{op}{operand}={result}")
            value = result
        return MathItem(key="", question=f"Compute {expression}.", answer=str(value), solution="\n".join(steps))


class ReasoningGymGenerator:
    """One reasoning-gym procedural generator; item for a seed = item 0 of a size-1 dataset with it.

    name: registered generator name (``basic_arithmetic``, ``chain_sum``, ...).
    config: keyword arguments of the generator's config dataclass (difficulty knobs).
    Raises ValueError for an unknown generator or a config key it does not take.
    """

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        self.name = name
        self.config = dict(config)
        self(0)  # fail at configuration time, not in the middle of training

    def __call__(self, seed: int) -> MathItem:
        import reasoning_gym

        try:
            entry = reasoning_gym.create_dataset(self.name, seed=seed, size=1, **self.config)[0]
        except TypeError as error:
            raise ValueError(f"reasoning_gym:{self.name}: bad source_kwargs {self.config}: {error}") from error
        return MathItem(key="", question=entry["question"], answer=str(entry["answer"]))


# ---------------------------------------------------------------------------------------------
# Splits


class FiniteSplit:
    """Hold-out and per-epoch shuffling over a fixed list of items.

    The items are shuffled once with ``seed``; the first ``num_val`` of that order are validation,
    the rest training. Training index ``i`` is position ``i % n`` of epoch ``i // n``'s shuffle of the
    training items, seeded by (seed, epoch), so the stream is a pure function of the config.
    """

    def __init__(self, items: list[MathItem], num_val: int, seed: int, origin: str) -> None:
        if num_val >= len(items):
            raise ValueError(
                f"{origin}: num_val_tasks={num_val} leaves no training rows out of {len(items)}"
            )
        order = shuffled_range(derive_seed(seed, "holdout"), len(items))
        self._val = [items[i] for i in order[:num_val]]
        self._train = [items[i] for i in order[num_val:]]
        self._seed = seed

    def train_item(self, index: int) -> MathItem:
        epoch, position = divmod(index, len(self._train))
        return self._train[shuffled_range(derive_seed(self._seed, "epoch", epoch), len(self._train))[position]]

    def val_items(self) -> list[MathItem]:
        return list(self._val)


class GeneratedSplit:
    """Train and validation problems drawn from a generator in separate seed namespaces.

    Validation draws ``num_val`` distinct questions from seeds derived from (seed, "val", j).
    Training index ``i`` uses seeds derived from (seed, "train", i, attempt) and is keyed by its
    question (a problem drawn twice is one task); a draw whose question is a validation question is redrawn, so train and validation never share a question — unless
    ``disjoint`` is false, for problem spaces so small that held-out questions would leave too
    little to train on (validation then measures in-distribution success).
    """

    def __init__(
        self, generate: Callable[[int], MathItem], num_val: int, seed: int, origin: str, disjoint: bool = True
    ) -> None:
        self._generate = generate
        self._seed = seed
        self._origin = origin
        self._val = self._draw_val(num_val)
        self._val_questions = {item.question for item in self._val} if disjoint else set()

    def train_item(self, index: int) -> MathItem:
        for attempt in range(_MAX_REDRAWS):
            item = self._generate(derive_seed(self._seed, "train", index, attempt))
            if item.question not in self._val_questions:
                # Keyed by the question, not the index: a problem drawn again is the same task, so a
                # replay buffer or an outcome history recognizes it.
                return _with_key(item, f"train/{hashlib.sha256(item.question.encode()).hexdigest()[:12]}")
        raise ValueError(
            f"{self._origin}: {_MAX_REDRAWS} draws all hit validation questions; the generator's problem "
            "space is too small for num_val_tasks"
        )

    def val_items(self) -> list[MathItem]:
        return list(self._val)

    def _draw_val(self, num_val: int) -> list[MathItem]:
        items: list[MathItem] = []
        seen: set[str] = set()
        draw = misses = 0
        while len(items) < num_val:
            if misses >= _MAX_REDRAWS:
                raise ValueError(
                    f"{self._origin}: found only {len(items)} distinct problems for num_val_tasks={num_val}"
                )
            item = self._generate(derive_seed(self._seed, "val", draw))
            draw += 1
            if item.question in seen:
                misses += 1
                continue
            seen.add(item.question)
            items.append(_with_key(item, f"val/{len(items)}"))
            misses = 0
        return items


def _with_key(item: MathItem, key: str) -> MathItem:
    return MathItem(key=key, question=item.question, answer=item.answer, solution=item.solution)
