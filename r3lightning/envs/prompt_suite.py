"""Your own single-turn task: prompts from a local file, rewards from your own functions (docs/own_task.md).

``PromptSuite`` reads rows from JSONL, Parquet or a local Hugging Face dataset. The prompt column holds a
string (the user message) or a list of chat messages (an optional system message and earlier turns, then
the user message). Every reward function named in ``reward_fn`` (``package.module:function`` or
``path/to/file.py:function``) is called as ``fn(completion=..., prompt=..., **row)`` with every column of
the row, and returns a float; several are summed with ``reward_weights``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.envs.math_sources import FiniteSplit, read_jsonl_rows, read_parquet_rows

PROMPT_SCHEMES = ("jsonl:<path>", "parquet:<path>", "hf:<local dataset directory>")
"""The ``source`` strings ``PromptSuite`` accepts."""
CHAT_ROLES = ("system", "user", "assistant")
RESERVED_COLUMNS = ("completion",)
"""Column names that would collide with the keyword arguments the reward functions receive."""
PROBE_TIMEOUT_S = 10.0
"""How long the set-up call of each reward function on the first row may take before set-up goes on
without its value (a slow function is then judged by the run's own calls, under ``agent.step_timeout_s``)."""


@dataclass(frozen=True)
class PromptRow:
    """One row: its 0-based index in the source, the user message, the chat messages before it (a
    system message, earlier turns; empty for a string prompt) and the whole row."""

    index: int
    user_message: str
    history: tuple[dict, ...]
    row: dict[str, Any]


@dataclass(frozen=True)
class RewardFunction:
    """A reward function and its weight; ``name`` is how the config named it."""

    name: str
    fn: Callable[..., Any]
    weight: float


def load_function(spec: str, key: str = "data.suite.init_args.reward_fn") -> Callable[..., Any]:
    """The function ``spec`` names: ``package.module:function`` (imported like ``python -m`` would: ``r3l``
    puts the working directory on ``sys.path``) or ``path/to/file.py:function``. Raises ValueError naming
    ``key`` and ``spec`` when it cannot be found or is not callable, or when its module does not import
    (a syntax error or an exception at import: the error, the module's file and line)."""
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{key}: {spec!r} is not 'package.module:function' or 'path/to/file.py:function'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser().resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no such file: {path}")
            loader_spec = importlib.util.spec_from_file_location(f"r3l_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, OSError) as error:
        raise ValueError(f"{key}: cannot import {module_name!r} for {spec!r}: {error}") from error
    except Exception as error:  # noqa: BLE001 - the user's module failed while it ran: say where
        raise ValueError(
            f"{key}: cannot import {module_name!r} for {spec!r}: {type(error).__name__}: {_error_text(error)} "
            f"({_error_place(error)})"
        ) from error
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ValueError(f"{key}: {module_name!r} has no function {attribute!r} (from {spec!r})")
    return fn


def _error_text(error: BaseException) -> str:
    return error.msg if isinstance(error, SyntaxError) and error.msg else str(error)


def _error_place(error: BaseException) -> str:
    """``file, line N``: of a syntax error, or of the module's own top-level statement that raised (the
    first frame past this function and the import machinery)."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}, line {error.lineno}"
    frames = traceback.extract_tb(error.__traceback__)[1:]
    own = [f for f in frames if not f.filename.startswith("<frozen") and "importlib" not in f.filename]
    frame = (own or frames or traceback.extract_tb(error.__traceback__))[0]
    return f"{frame.filename}, line {frame.lineno}"


def read_rows(source: str, hf_split: str = "train") -> list[dict[str, Any]]:
    """Rows of ``source`` (``PROMPT_SCHEMES``). ``hf:`` takes a local directory only: one written by
    ``Dataset.save_to_disk`` or one ``datasets.load_dataset`` reads (data files), split ``hf_split``."""
    scheme, _, argument = source.partition(":")
    if scheme == "jsonl" and argument:
        return read_jsonl_rows(argument)
    if scheme == "parquet" and argument:
        return read_parquet_rows(argument)
    if scheme == "hf" and argument:
        path = Path(argument).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"PromptSuite: hf: sources are local directories; {argument} does not exist")
        import datasets

        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            loaded = loaded[hf_split] if isinstance(loaded, datasets.DatasetDict) else loaded
        else:
            loaded = datasets.load_dataset(str(path), split=hf_split)
        return list(loaded)
    raise ValueError(f"PromptSuite: unknown source {source!r}; valid sources: {', '.join(PROMPT_SCHEMES)}")


def prompt_row(row: Any, index: int, prompt_column: str, origin: str) -> PromptRow:
    """Check one row and split its prompt into the user message and the messages before it. Raises
    ValueError naming ``origin``, the 1-based row and the column."""
    where = f"{origin}: row {index + 1}"
    if not isinstance(row, dict):
        raise ValueError(f"{where} is {type(row).__name__}, not an object with columns")
    if prompt_column not in row:
        raise ValueError(f"{where} has no {prompt_column!r} column (it has {sorted(row)}); set prompt_column")
    for column in RESERVED_COLUMNS:
        if column in row:
            raise ValueError(f"{where}: a column may not be named {column!r} (the reward functions receive it as the model's answer)")
    prompt = row[prompt_column]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: the {prompt_column!r} column is empty")
        return PromptRow(index, prompt, (), row)
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: {prompt_column!r} is {type(prompt).__name__}; expected a string or a list of chat messages")
    for number, message in enumerate(prompt, start=1):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES or not isinstance(message.get("content"), str):
            raise ValueError(
                f"{where}: message {number} of {prompt_column!r} is {message!r}; expected {{'role': one of {CHAT_ROLES}, 'content': text}}"
            )
    if prompt[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message of {prompt_column!r} is from {prompt[-1]['role']!r}; it must be the user's")
    history = tuple({"role": m["role"], "content": m["content"]} for m in prompt[:-1])
    return PromptRow(index, prompt[-1]["content"], history, row)


def reward_number(value: Any) -> tuple[Optional[float], str]:
    """``(float, "")`` for a reward function's value that is a finite real number (an int, a float, a
    numpy scalar) or a one-element tensor or array holding one; ``(None, what is wrong)`` otherwise.
    ``bool`` is refused: ``True``/``False`` is more often a check returned by mistake than a score, and
    ``float(correct)`` says which it is."""
    if hasattr(value, "item") and not isinstance(value, numbers.Real):
        size = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)  # torch, numpy
        if size != 1:
            return None, f"a {type(value).__name__} of {size} elements, not one number"
        value = value.item()
    if isinstance(value, bool):
        return None, f"a bool; return float({value}) if a check is the score"
    if isinstance(value, str):
        return None, "text, not a number; return float(...)"
    if not isinstance(value, numbers.Real):
        return None, f"a {type(value).__name__}, not a number"
    if not math.isfinite(value):
        return None, "not finite"
    return float(value), ""


class RewardFunctionError(ValueError):
    """A reward function raised or returned something that is not a finite number (the sample is masked)."""


class PromptEnv:
    """One answer per episode, scored by the reward functions: ``sum(weight * fn(completion=action,
    prompt=<the prompt column's value>, **row))``. Success: the reward reaches ``success_reward``."""

    def __init__(self, rewards: tuple[RewardFunction, ...], prompt_column: str, success_reward: float) -> None:
        self.rewards, self.prompt_column, self.success_reward = rewards, prompt_column, success_reward
        self._task: Optional[Task] = None

    def reset(self, task: Task) -> str:
        self._task = task
        return task.prompt

    def step(self, action: str) -> StepResult:
        """Score ``action`` (the whole response). A function that raises or returns something other
        than a finite number (``reward_number``) raises ``RewardFunctionError`` naming it, the row and the
        error; the agent loop masks the sample and counts it."""
        if self._task is None:
            raise RuntimeError("PromptEnv.step() called with no episode running; call reset(task) first")
        task, self._task = self._task, None
        row = task.data["row"]
        arguments = {**row, "prompt": row[self.prompt_column], "completion": action}
        total, parts = 0.0, {}
        where = f"row {task.data['row_number']} of {task.data['origin']} (task {task.task_id!r})"
        for reward in self.rewards:
            try:
                value = reward.fn(**arguments)
            except Exception as err:  # noqa: BLE001 - the user's function: masked, named, counted
                raise RewardFunctionError(f"reward_fn {reward.name!r} raised {type(err).__name__}: {err} on {where}") from err
            number, problem = reward_number(value)
            if number is None:
                raise RewardFunctionError(
                    f"reward_fn {reward.name!r} returned {value!r} on {where}: {problem}; it must return a finite float"
                )
            parts[reward.name] = number
            total += reward.weight * number
        feedback = f"Reward: {total:g}."
        info = {"feedback": feedback, "success": total >= self.success_reward, "rewards": parts}
        return StepResult(feedback, total, True, info)


def check_reward_functions(
    rewards: tuple[RewardFunction, ...], row: PromptRow, prompt_column: str, origin: str, demo_column: Optional[str]
) -> None:
    """Check every reward function on a real row (``row``, the file's first) before any training: its
    signature must take ``fn(completion=..., prompt=..., **row)`` with this row's columns, and one call
    (the completion is the row's ``demo_column`` value, else the empty string) must give a finite number
    (``reward_number``). A call that raises or takes longer than ``PROBE_TIMEOUT_S`` is not judged here:
    an empty answer may fairly fail, and the run masks, counts and (when every call of a step fails)
    stops on such calls. Raises ValueError naming the function, the row and what to change."""
    completion = str(row.row[demo_column]) if demo_column is not None else ""
    arguments = {**row.row, "prompt": row.row[prompt_column], "completion": completion}
    where = f"row {row.index + 1} of {origin} (columns {sorted(row.row)})"
    for reward in rewards:
        key = f"data.suite.init_args.reward_fn {reward.name!r}"
        try:
            inspect.signature(reward.fn).bind(**arguments)
        except TypeError as err:
            name = getattr(reward.fn, "__name__", "reward")
            raise ValueError(
                f"{key} cannot be called as fn(completion=..., prompt=..., **row) with {where}: {err}; "
                f"take every column, e.g. def {name}(completion, **row)"
            ) from None
        except ValueError:
            pass  # no signature to read (a builtin): the call below tells
        outcome: dict[str, Any] = {}

        def probe(fn=reward.fn) -> None:
            try:
                outcome["value"] = fn(**arguments)
            except Exception:  # noqa: BLE001 - judged by the run's own calls (see above)
                pass

        worker = threading.Thread(target=probe, daemon=True, name="r3l-reward-probe")
        worker.start()
        worker.join(PROBE_TIMEOUT_S)
        if "value" in outcome:
            number, problem = reward_number(outcome["value"])
            if number is None:
                raise ValueError(
                    f"{key} returned {outcome['value']!r} on {where} with completion {completion!r}: {problem}; "
                    "it must return a finite float"
                )


class PromptSuite(TaskSuite):
    """Your own single-turn task (docs/own_task.md): prompts from a local file, rewards from your
    functions. The response is read raw (``answer_format``).

    Args:
        source: ``jsonl:<path>``, ``parquet:<path>`` or ``hf:<directory>`` (a local Hugging Face dataset:
            ``save_to_disk`` output or data files ``datasets.load_dataset`` reads; no download).
        reward_fn: the reward function, ``package.module:function`` (the working directory is importable)
            or ``path/to/file.py:function``, or a list of them. Each is called as ``fn(completion=...,
            prompt=..., **row)``: the response text, the prompt column's value (a string or the chat
            messages) and every column of the row; it returns a float. Rewards are read in [0, 1]:
            ``data.agent.reward_out_of_range`` clips or masks others, and counts them.
        reward_weights: one weight per function (default 1 each); the episode's reward is the weighted sum.
        prompt_column: the column holding the prompt: a string (the user message) or a list of chat
            messages (``{"role", "content"}``; an optional system message and earlier turns, then the
            user message). A row's system message replaces ``system_prompt``.
        system_prompt: the system message of conversations whose prompt has none (empty: none).
        demo_column: the column holding a reference answer used as the SFT warm-start demonstration
            (``model.phases.warmstart.demos.source: suite``); null: no demonstrations.
        num_val_tasks: rows held out for validation (the first of a shuffle seeded by ``seed``).
        seed: seeds the hold-out and the per-epoch shuffles.
        success_reward: an episode whose reward reaches this counts as a success (``reward/success_rate``).
        hf_split: the split of an ``hf:`` source.
    """

    answer_format = "raw"

    def __init__(
        self,
        source: str,
        reward_fn: Union[str, list[str]],
        reward_weights: Optional[list[float]] = None,
        prompt_column: str = "prompt",
        system_prompt: str = "",
        demo_column: Optional[str] = None,
        num_val_tasks: int = 16,
        seed: int = 0,
        success_reward: float = 1.0,
        hf_split: str = "train",
    ) -> None:
        names = [reward_fn] if isinstance(reward_fn, str) else list(reward_fn)
        if not names:
            raise ValueError("PromptSuite: reward_fn names no function")
        weights = [1.0] * len(names) if reward_weights is None else [float(w) for w in reward_weights]
        if len(weights) != len(names):
            raise ValueError(f"PromptSuite: {len(weights)} reward_weights for {len(names)} reward functions")
        if num_val_tasks < 0:
            raise ValueError(f"PromptSuite: num_val_tasks must be >= 0, got {num_val_tasks}")
        self.rewards = tuple(RewardFunction(name, load_function(name), weight) for name, weight in zip(names, weights))
        self.source = source
        self.prompt_column = prompt_column
        self.system_prompt = system_prompt
        self.demo_column = demo_column
        self.success_reward = success_reward
        origin = source.partition(":")[2] or source
        rows = [prompt_row(row, i, prompt_column, origin) for i, row in enumerate(read_rows(source, hf_split))]
        if not rows:
            raise ValueError(f"{origin}: the dataset is empty")
        if demo_column is not None:
            missing = next((r for r in rows if demo_column not in r.row), None)
            if missing is not None:
                raise ValueError(f"{origin}: row {missing.index + 1} has no {demo_column!r} column (demo_column)")
        self._origin = origin
        check_reward_functions(self.rewards, rows[0], prompt_column, origin, demo_column)
        self._split = FiniteSplit(rows, num_val_tasks, seed, origin)

    def make_env(self) -> PromptEnv:
        return PromptEnv(self.rewards, self.prompt_column, self.success_reward)

    def train_task(self, index: int) -> Task:
        if index < 0:
            raise IndexError(f"PromptSuite: train_task index must be >= 0, got {index}")
        return self._task(self._split.train_item(index), "train")

    def val_tasks(self) -> list[Task]:
        return [self._task(row, "val") for row in self._split.val_items()]

    def demonstration(self, task: Task) -> Optional[list[str]]:
        if self.demo_column is None:
            return None
        return [str(task.data["row"][self.demo_column])]

    def describe(self) -> str:
        names = ", ".join(repr(r.name) for r in self.rewards)
        return f"PromptSuite ({self.source}, reward_fn {names})"

    def _task(self, row: PromptRow, split: str) -> Task:
        return Task(
            task_id=f"{self.source}#row{row.index}",
            prompt=row.user_message,
            data={"row": row.row, "split": split, "row_number": row.index + 1, "origin": self._origin},
            history=list(row.history) or None,
        )

