"""Math question answering: answer extraction, verification under a deadline, ``MathEnv`` and ``MathSuite``.

The model answers in ``\\boxed{...}`` (or ``<answer>...</answer>``, or an ``Answer:`` line); the
answer is checked against the reference by an exact/integer fast path and otherwise by
``math_verify``. ``math_verify`` can hang on adversarial input and its own timeout uses
``signal.alarm``, which only works in the main thread and cannot interrupt long C-level sympy work.
So it runs in a worker subprocess that is killed when it misses the deadline; a timeout or a crash
raises ``VerifierError``, which ``MathEnv`` reports as ``info["reward_error"] = True``.

Task sources live in ``math_sources``; ``MathSuite(source=...)`` picks one.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.envs.math_sources import (
    SCHEMES,
    ArithmeticGenerator,
    FiniteSplit,
    GeneratedSplit,
    MathItem,
    ReasoningGymGenerator,
    champ_items,
    items_from_rows,
    read_hf_rows,
    read_jsonl_rows,
    read_parquet_rows,
)

DEFAULT_INSTRUCTION = "Put your final answer in \\boxed{}."
DEFAULT_SYSTEM_PROMPT = "You are a helpful math assistant."

FEEDBACK_CORRECT = "Correct."
FEEDBACK_INCORRECT = "Incorrect, try again."
FEEDBACK_NO_ANSWER = "No final answer found; put it in \\boxed{}."
FEEDBACK_NO_NUMBER = "No number found; answer with the number."
FEEDBACK_VERIFIER_ERROR = "The answer could not be checked."


class VerifierError(RuntimeError):
    """The verifier timed out or failed; the sample's reward is unknown and must be masked."""


# ---------------------------------------------------------------------------------------------
# Answer extraction

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_LINE = re.compile(r"^[ \t]*answer[ \t]*:(.*)$", re.MULTILINE | re.IGNORECASE)


def extract_answer(text: str) -> Optional[str]:
    """The final answer in ``text`` (str), stripped, or None.

    Priority: the last non-empty ``\\boxed{...}`` (braces balanced, nesting and ``\\{`` allowed; a box
    cut off before its closing brace is ignored), else the last ``<answer>...</answer>``, else the
    last line starting with ``Answer:`` (any case).
    """
    for match in reversed(list(_BOXED.finditer(text))):
        content = _braced_content(text, match.end())
        if content is not None and content.strip():
            return content.strip()
    for pattern in (_ANSWER_TAG, _ANSWER_LINE):
        for content in reversed(pattern.findall(text)):
            if content.strip():
                return content.strip()
    return None


_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")


def extract_last_number(text: str) -> Optional[str]:
    """The last number in ``text`` (an integer or decimal, with its sign), or None: the final answer of
    a model told to answer with the number only, which writes "7 + 12 = 19" as readily as "19"."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return numbers[-1] if numbers else None


FINAL_ANSWER_READERS = {"boxed": extract_answer, "last_number": extract_last_number}
"""How ``MathEnv`` finds the final answer in a response (``MathSuite.final_answer``)."""


def _braced_content(text: str, start: int) -> Optional[str]:
    """Text from ``start`` to the brace that closes the ``{`` just before it; None if never closed."""
    depth = 1
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped character (``\{``, ``\}``) never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


# ---------------------------------------------------------------------------------------------
# Verification

_INTEGER = re.compile(r"[+-]?\d{1,100}")


def normalize_answer(answer: str) -> str:
    """Strip whitespace, enclosing ``$...$`` and a trailing period (``"$19$."`` -> ``"19"``)."""
    answer = answer.strip().rstrip(".").strip()
    while len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer[1:-1].strip()
    return answer


def numeric_closeness(predicted: str, reference: str) -> Optional[float]:
    """``1 / (1 + |p - r|)`` for two integer answers (1 when equal, 1/2 one off, 1/11 ten off); None
    when either is not an integer. The partial credit of a readable wrong answer, for R³'s premise gate
    (does the ranking order failures by closeness to success?); never a reward."""
    predicted, reference = normalize_answer(predicted), normalize_answer(reference)
    if not (_INTEGER.fullmatch(predicted) and _INTEGER.fullmatch(reference)):
        return None
    return 1.0 / (1.0 + abs(int(predicted) - int(reference)))


def verify_answer(
    predicted: str, reference: str, timeout_s: float = 5.0, verifier: Optional["MathVerifier"] = None
) -> bool:
    """Whether ``predicted`` (str) is mathematically equal to ``reference`` (str).

    Equal strings (ignoring whitespace) and integer pairs are decided here; anything else goes to
    ``math_verify`` in a worker process (``verifier``, default the process-wide ``default_verifier()``)
    with a deadline of ``timeout_s`` seconds. Unparseable predictions are simply wrong.
    Raises VerifierError when the worker times out or fails.
    """
    predicted, reference = normalize_answer(predicted), normalize_answer(reference)
    if not predicted or not reference:
        return False
    if "".join(predicted.split()) == "".join(reference.split()):
        return True
    if _INTEGER.fullmatch(predicted) and _INTEGER.fullmatch(reference):
        return int(predicted) == int(reference)
    return (verifier or default_verifier()).verify(predicted, reference, timeout_s)


def math_verify_equal(predicted: str, reference: str) -> bool:
    """``math_verify`` parse + verify of two extracted answers, without any timeout (worker side).

    Both are wrapped in ``\\boxed{}`` so math_verify reads each as one whole answer: bare text is
    parsed leniently (``2^(n-1)`` becomes ``2``).
    """
    from math_verify import parse, verify

    # Timeouts off: math_verify's alarm-based timeout would turn a hang into a silent False; the
    # parent's deadline turns it into a VerifierError instead.
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
    target = parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
    return bool(verify(gold, target, timeout_seconds=None))


def run_verifier_worker() -> None:
    """Worker process main loop: JSON requests ``{"predicted", "reference"}`` on stdin, one per line;
    replies ``{"ok": bool}`` or ``{"error": str}`` on stdout, after a ``{"ready": true}`` greeting."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints (even from C) must not corrupt replies
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silences "timeout is disabled" warnings
    import math_verify  # noqa: F401  (imported before the greeting so startup never eats a deadline)

    _send(replies, {"ready": True})
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply: dict[str, Any] = {"ok": math_verify_equal(request["predicted"], request["reference"])}
        except Exception as error:  # reported to the caller as a VerifierError
            reply = {"error": f"{type(error).__name__}: {error}"}
        _send(replies, reply)


def _send(stream: Any, message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


class MathVerifier:
    """A ``math_verify`` worker subprocess with per-call deadlines; thread-safe (calls are serialized).

    command: argv that starts the worker (default: this module's ``run_verifier_worker`` under the
        current interpreter); tests substitute a worker that hangs.
    startup_timeout_s: how long the worker may take to import math_verify. It is not part of any
        call's deadline, so the first call can take longer than its ``timeout_s``.

    On a timeout or crash the worker is killed and a fresh one starts on the next call.
    """

    def __init__(self, command: Optional[Sequence[str]] = None, startup_timeout_s: float = 120.0) -> None:
        self.command = list(command) if command else _default_worker_command()
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._process: Optional[subprocess.Popen] = None
        self._owner_pid = 0
        self._buffer = b""

    def verify(self, predicted: str, reference: str, timeout_s: float) -> bool:
        """math_verify's verdict on two extracted answers within ``timeout_s`` seconds.

        Raises VerifierError on timeout, worker crash or an exception inside math_verify.
        """
        with self._lock:
            process = self._running_process()
            request = json.dumps({"predicted": predicted, "reference": reference}) + "\n"
            try:
                process.stdin.write(request.encode())
                process.stdin.flush()
            except OSError as error:
                self._stop()
                raise VerifierError(f"math_verify worker is gone: {error}") from error
            reply = self._read_message(timeout_s, "math_verify")
        if "error" in reply:
            raise VerifierError(f"math_verify failed: {reply['error']}")
        return bool(reply["ok"])

    def close(self) -> None:
        """Stop the worker (a later ``verify`` starts a new one)."""
        with self._lock:
            self._stop()

    def _running_process(self) -> subprocess.Popen:
        # A forked child inherits the parent's pipes; talking to the parent's worker would interleave
        # replies, so each process starts its own.
        if self._process is not None and self._owner_pid == os.getpid() and self._process.poll() is None:
            return self._process
        if self._owner_pid == os.getpid():
            self._stop()
        self._process = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_worker_environment()
        )
        self._owner_pid = os.getpid()
        self._buffer = b""
        greeting = self._read_message(self.startup_timeout_s, "math_verify worker startup")
        if not greeting.get("ready"):
            self._stop()
            raise VerifierError(f"math_verify worker sent {greeting} instead of its greeting")
        return self._process

    def _read_message(self, timeout_s: float, what: str) -> dict[str, Any]:
        """One JSON line from the worker; kills it and raises VerifierError past the deadline."""
        deadline = time.monotonic() + timeout_s
        stdout = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([stdout], [], [], remaining)[0]:
                self._stop()
                raise VerifierError(f"{what} timed out after {timeout_s:g}s")
            chunk = os.read(stdout, 65536)
            if not chunk:
                self._stop()
                raise VerifierError(f"{what}: the worker exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except json.JSONDecodeError as error:
            self._stop()
            raise VerifierError(f"{what}: unreadable reply {line[:200]!r}") from error

    def _stop(self) -> None:
        process, self._process = self._process, None
        self._buffer = b""
        if process is None or self._owner_pid != os.getpid():
            return
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdin.close()
        process.stdout.close()


def _default_worker_command() -> list[str]:
    return [sys.executable, "-c", "from r3lightning.envs.math_env import run_verifier_worker; run_verifier_worker()"]


def _worker_environment() -> dict[str, str]:
    """The current environment with this package's root on PYTHONPATH (it may not be installed)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + os.pathsep + path if path else root}


_default_verifier: Optional[MathVerifier] = None
_default_verifier_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide ``MathVerifier`` (one worker per process, started on first use)."""
    global _default_verifier
    with _default_verifier_lock:
        if _default_verifier is None:
            _default_verifier = MathVerifier()
            atexit.register(_default_verifier.close)
        return _default_verifier


# ---------------------------------------------------------------------------------------------
# Environment


class MathEnv:
    """Answer a math question, optionally retrying after "Incorrect, try again." feedback.

    max_attempts: answers allowed per episode. A wrong or missing answer with attempts left returns
        done=False and the feedback as the next observation.
    verify_timeout_s: deadline for one verification (see ``verify_answer``).
    verifier: the MathVerifier to use (default: the process-wide one).
    final_answer: ``boxed`` (``extract_answer``) or ``last_number`` (``extract_last_number``).

    Reward is 1.0 when an attempt is correct (at any attempt, undiscounted) and 0.0 otherwise, given
    on the final step. A verifier timeout/failure ends the episode with reward 0.0 and
    ``info["reward_error"] = True`` so the sample is masked.
    """

    def __init__(
        self,
        max_attempts: int = 1,
        verify_timeout_s: float = 5.0,
        verifier: Optional[MathVerifier] = None,
        final_answer: Literal["boxed", "last_number"] = "boxed",
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"MathEnv: max_attempts must be >= 1, got {max_attempts}")
        if final_answer not in FINAL_ANSWER_READERS:
            raise ValueError(f"MathEnv: final_answer must be one of {', '.join(FINAL_ANSWER_READERS)}, got {final_answer!r}")
        self.read_answer = FINAL_ANSWER_READERS[final_answer]
        self.no_answer_feedback = FEEDBACK_NO_NUMBER if final_answer == "last_number" else FEEDBACK_NO_ANSWER
        self.max_attempts = max_attempts
        self.verify_timeout_s = verify_timeout_s
        self.verifier = verifier
        self._task: Optional[Task] = None
        self._attempts = 0
        self._done = True

    def reset(self, task: Task) -> str:
        """Start ``task``; returns ``task.prompt`` (the question with its answer-format instruction)."""
        if task.answer is None:
            raise ValueError(f"MathEnv: task {task.task_id!r} has no reference answer")
        self._task = task
        self._attempts = 0
        self._done = False
        return task.prompt

    def step(self, action: str) -> StepResult:
        """Check the answer in ``action`` (the model's whole response)."""
        if self._done or self._task is None:
            raise RuntimeError("MathEnv.step() called with no episode running; call reset(task) first")
        self._attempts += 1
        predicted = self.read_answer(action)
        info: dict[str, Any] = {"attempt": self._attempts, "extracted_answer": predicted, "reward_error": False}
        if predicted is None:
            # No readable answer: the environment rejects the action (counted per trajectory as
            # ``rejected_actions``; R³'s ranking puts such failures below readable wrong answers).
            return self._wrong({**info, "invalid_action": True}, self.no_answer_feedback)
        try:
            correct = verify_answer(predicted, self._task.answer, self.verify_timeout_s, self.verifier)
        except VerifierError as error:
            info.update(reward_error=True, verifier_error=str(error))
            return self._finish(0.0, FEEDBACK_VERIFIER_ERROR, False, info)
        if correct:
            return self._finish(1.0, FEEDBACK_CORRECT, True, info)
        credit = numeric_closeness(predicted, self._task.answer)
        if credit is not None:
            info["partial_credit"] = credit
        return self._wrong(info, FEEDBACK_INCORRECT)

    def _wrong(self, info: dict[str, Any], feedback: str) -> StepResult:
        if self._attempts < self.max_attempts:
            return StepResult(feedback, 0.0, False, {**info, "feedback": feedback, "success": False})
        return self._finish(0.0, feedback, False, info)

    def _finish(self, reward: float, feedback: str, success: bool, info: dict[str, Any]) -> StepResult:
        self._done = True
        return StepResult(feedback, reward, True, {**info, "feedback": feedback, "success": success})


# ---------------------------------------------------------------------------------------------
# Task suite


class MathSuite(TaskSuite):
    """Math problems from a generator or a dataset, with a held-out validation set.

    Args:
        source: where problems come from. ``arithmetic``: built-in two-operand integer problems
            ("Compute 7+12."), offline and instant. ``reasoning_gym:<generator>``: a reasoning-gym
            procedural generator, e.g. ``reasoning_gym:basic_arithmetic``. ``champ``: the 270 CHAMP
            competition problems of the champ-dataset package (offline). ``jsonl:<path>`` /
            ``parquet:<path>``: a local file with one problem per row. ``hf:<name>``: a Hugging Face
            dataset (needs network or the HF cache).
        source_kwargs: generator settings. For ``arithmetic``: ``max_operand`` (default 20),
            ``operators`` (subset of "+-*", default "+-"), ``nonnegative`` (default true). For
            ``reasoning_gym:*``: fields of the generator's config, e.g. ``{"max_terms": 2}``.
        question_field: row field holding the question (jsonl/parquet/hf).
        answer_field: row field holding the reference answer (jsonl/parquet/hf).
        solution_field: row field holding a worked solution, used by ``demo_style: solution``.
        hf_config: dataset configuration name for ``hf:`` sources (e.g. "main" for gsm8k).
        hf_split: dataset split for ``hf:`` sources.
        max_attempts: answers per episode; wrong answers get "Incorrect, try again." until used up.
        num_val_tasks: size of the validation set. Generators draw it from their own seed namespace
            and never train on its questions; datasets hold out the first ``num_val_tasks`` rows of a
            shuffle seeded by ``seed``.
        seed: seeds the hold-out, the per-epoch shuffles and the generators.
        val_disjoint: generator sources only: never train on a validation question. Set false for
            problem spaces so small (e.g. single-digit arithmetic) that holding questions out leaves
            too little to learn from; validation then measures in-distribution success.
        system_prompt: the system message of each conversation.
        instruction: appended to each question on its own line; empty for none.
        demo_style: SFT demonstration: ``answer_only`` (just ``\\boxed{answer}``) or ``solution``
            (the source's worked solution, then the boxed answer).
        verify_timeout_s: seconds one verification may take before the sample is masked.
        final_answer: where the verifier finds the answer in the response: ``boxed`` (the last
            ``\\boxed{}``, ``<answer>`` tag or ``Answer:`` line) or ``last_number`` (the last number, for
            an instruction such as "Answer with the number only."; demonstrations are then the bare answer).

    The verifier reads the whole response (``answer_format = "raw"``).
    """

    answer_format = "raw"

    def __init__(
        self,
        source: str = "arithmetic",
        source_kwargs: Optional[dict[str, Any]] = None,
        question_field: str = "question",
        answer_field: str = "answer",
        solution_field: Optional[str] = None,
        hf_config: Optional[str] = None,
        hf_split: str = "train",
        max_attempts: int = 1,
        num_val_tasks: int = 64,
        seed: int = 0,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        instruction: str = DEFAULT_INSTRUCTION,
        demo_style: Literal["answer_only", "solution"] = "answer_only",
        verify_timeout_s: float = 5.0,
        val_disjoint: bool = True,
        final_answer: Literal["boxed", "last_number"] = "boxed",
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"MathSuite: max_attempts must be >= 1, got {max_attempts}")
        if final_answer not in FINAL_ANSWER_READERS:
            raise ValueError(f"MathSuite: final_answer must be one of {', '.join(FINAL_ANSWER_READERS)}, got {final_answer!r}")
        if num_val_tasks < 0:
            raise ValueError(f"MathSuite: num_val_tasks must be >= 0, got {num_val_tasks}")
        if demo_style not in ("answer_only", "solution"):
            raise ValueError(f"MathSuite: demo_style must be 'answer_only' or 'solution', got {demo_style!r}")
        self.source = source
        self.max_attempts = self.max_turns = max_attempts
        self.system_prompt = system_prompt
        self.instruction = instruction
        self.demo_style = demo_style
        self.verify_timeout_s = verify_timeout_s
        self.final_answer = final_answer
        fields = (question_field, answer_field, solution_field)
        self._split = _make_split(
            source, dict(source_kwargs or {}), fields, hf_config, hf_split, num_val_tasks, seed, val_disjoint
        )
        if demo_style == "solution" and self._split.train_item(0).solution is None:
            raise ValueError(
                f"MathSuite: demo_style='solution' but source {source!r} provides no solutions "
                "(set solution_field for jsonl/parquet/hf sources)"
            )

    def make_env(self) -> MathEnv:
        return MathEnv(max_attempts=self.max_attempts, verify_timeout_s=self.verify_timeout_s, final_answer=self.final_answer)

    def train_task(self, index: int) -> Task:
        if index < 0:
            raise IndexError(f"MathSuite: train_task index must be >= 0, got {index}")
        return self._task(self._split.train_item(index), "train")

    def val_tasks(self) -> list[Task]:
        return [self._task(item, "val") for item in self._split.val_items()]

    def feedback_texts(self) -> tuple[str, ...]:
        no_answer = FEEDBACK_NO_NUMBER if self.final_answer == "last_number" else FEEDBACK_NO_ANSWER
        return (FEEDBACK_INCORRECT, no_answer, FEEDBACK_VERIFIER_ERROR)

    def demonstration(self, task: Task) -> Optional[list[str]]:
        """One expert answer: ``\\boxed{answer}`` (the bare answer for ``final_answer: last_number``),
        preceded by the worked solution for ``demo_style: solution``."""
        if task.answer is None:
            return None
        boxed = str(task.answer) if self.final_answer == "last_number" else f"\\boxed{{{task.answer}}}"
        solution = task.data.get("solution")
        if self.demo_style == "solution" and solution:
            return [f"{solution}\n{boxed}"]
        return [boxed]

    def _task(self, item: MathItem, split: str) -> Task:
        prompt = f"{item.question}\n{self.instruction}" if self.instruction else item.question
        return Task(
            task_id=f"{self.source}#{item.key}",
            prompt=prompt,
            answer=item.answer,
            data={"question": item.question, "solution": item.solution, "split": split},
        )


def _make_split(
    source: str,
    source_kwargs: dict[str, Any],
    fields: tuple[str, str, Optional[str]],
    hf_config: Optional[str],
    hf_split: str,
    num_val: int,
    seed: int,
    val_disjoint: bool = True,
) -> FiniteSplit | GeneratedSplit:
    """The train/val split for a ``source`` string (see ``MathSuite``)."""
    scheme, _, argument = source.partition(":")
    if scheme == "arithmetic" and not argument:
        try:
            generator = ArithmeticGenerator(**source_kwargs)
        except TypeError as error:
            raise ValueError(f"arithmetic: bad source_kwargs {source_kwargs}: {error}") from error
        return GeneratedSplit(generator, num_val, seed, source, val_disjoint)
    if scheme == "reasoning_gym" and argument:
        return GeneratedSplit(ReasoningGymGenerator(argument, source_kwargs), num_val, seed, source, val_disjoint)
    if source_kwargs:
        raise ValueError(f"source_kwargs are for generator sources, not {source!r}")
    if scheme == "champ" and not argument:
        return FiniteSplit(champ_items(), num_val, seed, source)
    readers = {"jsonl": read_jsonl_rows, "parquet": read_parquet_rows}
    if scheme in readers and argument:
        rows = readers[scheme](argument)
    elif scheme == "hf" and argument:
        rows = read_hf_rows(argument, hf_config, hf_split)
    else:
        raise ValueError(f"unknown math source {source!r}; valid sources: {', '.join(SCHEMES)}")
    return FiniteSplit(items_from_rows(rows, argument, *fields), num_val, seed, source)
