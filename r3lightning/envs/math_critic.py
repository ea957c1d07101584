"""A scripted critic for arithmetic questions: it knows the correct derivation, so it can name the
wrong step of a wrong answer and correct it (ReflectRL's reflective SFT, docs/reflectrl.md).

It covers every question that holds one integer/decimal expression with ``+ - * /``, parentheses and
unary minus: the built-in ``arithmetic`` source ("Compute 7+3.") and reasoning-gym's
``basic_arithmetic`` and ``chain_sum`` ("Calculate ( 56 + -33 ) - 84."). The derivation is the
expression's binary operations in evaluation order, computed exactly (``fractions.Fraction``); when
it does not reproduce the task's reference answer the critic declines (returns None) rather than
teach a wrong correction.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional

from r3lightning.envs.base import Task
from r3lightning.envs.math_env import extract_answer, normalize_answer

_EXPRESSION = re.compile(r"[-+*/()\d.\s]+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_EQUATION = re.compile(r"([-+*/()\d.\s]+?)=\s*(-?\d+(?:\.\d+)?)")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclass(frozen=True)
class Step:
    """One binary operation of a derivation: ``left op right = value`` (operands as written)."""

    left: str
    op: str
    right: str
    value: Fraction

    @property
    def lhs(self) -> str:
        right = f"({self.right})" if self.right.startswith("-") else self.right
        return f"{self.left}{self.op}{right}"

    @property
    def text(self) -> str:
        return f"{self.lhs}={format_number(self.value)}"


@dataclass(frozen=True)
class Critique:
    """A critique of a wrong response.

    wrong_step: the first claim of the response that is false (``7+3=9``; for an answer with no
        written steps, the whole expression set equal to the answer).
    correction: the correct derivation from there, steps separated by ``; ``.
    answer: the correct final answer.
    derivation: the whole correct derivation, one step's text per item (``7+3=10``, ``10-2=8``).
    """

    wrong_step: str
    correction: str
    answer: str
    derivation: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The assistant message reflective SFT trains on: wrong step, correction, boxed answer."""
        return f"Wrong step: {self.wrong_step}\nCorrection: {self.correction}\n\\boxed{{{self.answer}}}"

    @property
    def solution(self) -> str:
        """The corrected answer in the direct answers' format (a step per line, then the boxed answer, as
        ``MathSuite.demonstration`` writes it with ``demo_style: solution``): ReflectRL's format-matched
        reflective target (``r3l reflect-sft --target solution``)."""
        return "\n".join([*self.derivation, f"\\boxed{{{self.answer}}}"])


def format_number(value: Fraction) -> str:
    """``7``, ``-3``, ``2.5``; a non-terminating fraction as ``a/b``."""
    if value.denominator == 1:
        return str(value.numerator)
    as_float = float(value)
    if Fraction(str(as_float)) == value:
        return str(as_float)
    return f"{value.numerator}/{value.denominator}"


def find_expression(question: str) -> Optional[str]:
    """The longest span of ``question`` that is an arithmetic expression with at least one binary
    operator (trailing ``.`` and ``=`` removed), or None."""
    best = None
    for match in _EXPRESSION.finditer(question):
        text = match.group(0).strip().rstrip(".=").strip()
        if not text or _evaluate(text) is None or len(_NUMBER.findall(text)) < 2:
            continue
        if best is None or len(text) > len(best):
            best = text
    return best


def _parse(expression: str) -> Optional[ast.expr]:
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    return tree.body


def _evaluate(expression: str) -> Optional[Fraction]:
    node = _parse(expression)
    if node is None:
        return None
    try:
        return _value(node, None)
    except (ValueError, ZeroDivisionError):
        return None


def _value(node: ast.expr, steps: Optional[list[Step]]) -> Fraction:
    """Exact value of an arithmetic AST; appends each binary operation to ``steps`` in evaluation order."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand, steps)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, steps), _value(node.right, steps)
        op = _OPS[type(node.op)]
        if op == "+":
            value = left + right
        elif op == "-":
            value = left - right
        elif op == "*":
            value = left * right
        else:
            value = left / right
        if steps is not None:
            steps.append(Step(format_number(left), op, format_number(right), value))
        return value
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


def derivation(expression: str) -> Optional[list[Step]]:
    """The binary operations of ``expression`` in evaluation order (list[Step]), or None when it is
    not a plain arithmetic expression or divides by zero."""
    node = _parse(expression)
    if node is None:
        return None
    steps: list[Step] = []
    try:
        _value(node, steps)
    except (ValueError, ZeroDivisionError):
        return None
    return steps


def _same_number(text: str, value: Fraction) -> bool:
    try:
        return Fraction(normalize_answer(text).replace(" ", "")) == value
    except (ValueError, ZeroDivisionError):
        return False


def first_false_claim(response: str) -> Optional[str]:
    """The first ``expression = number`` written in ``response`` whose value is not that number
    (``"7+3=9"``, spaces removed), or None when every written equation is right (or there is none)."""
    for match in _EQUATION.finditer(response):
        # The expression right before "=": not a sentence that ended before it ("Compute 7+3. 7+3=9").
        lhs, claimed = re.split(r"\.\s|\n", match.group(1))[-1].strip(), match.group(2)
        value = _evaluate(lhs) if len(_NUMBER.findall(lhs)) >= 2 else None
        if value is not None and not _same_number(claimed, value):
            return f"{''.join(lhs.split())}={claimed}"
    return None


def scripted_critique(task: Task, wrong_response: str, read_answer: Callable[[str], Optional[str]] = extract_answer) -> Optional[Critique]:
    """A critique of ``wrong_response`` (str) to ``task`` (a math task: ``task.data["question"]`` or
    its prompt holds one arithmetic expression; ``task.answer`` the reference), or None when the
    question has no such expression, the derivation does not give the reference answer, or the
    response is in fact right. ``read_answer`` finds the response's final answer (the suite's reader:
    ``\\boxed{}`` by default, the last number for ``final_answer: last_number``).

    The wrong step is the first false equation the response writes; with none, it is the implied
    claim ``expression = the response's final answer`` (or ``no final answer``). The correction is the
    derivation from the operation that claim concerns to the end.
    """
    question = str(task.data.get("question") or task.prompt)
    expression = find_expression(question)
    if expression is None or task.answer is None:
        return None
    steps = derivation(expression)
    if not steps or not _same_number(task.answer, steps[-1].value):
        return None
    predicted = read_answer(wrong_response)
    if predicted is not None and _same_number(predicted, steps[-1].value):
        return None
    answer = format_number(steps[-1].value)
    wrong = first_false_claim(wrong_response)
    start = 0
    if wrong is not None:
        lhs = wrong.split("=")[0].replace("(", "").replace(")", "")
        # Correct from the step that computes the same operation, if the derivation has it.
        for i, step in enumerate(steps):
            if f"{step.left}{step.op}{step.right}" == lhs:
                start = i
                break
    else:
        compact = "".join(expression.split())
        wrong = f"{compact}={predicted}" if predicted is not None else "no final answer"
    correction = "; ".join(step.text for step in steps[start:])
    return Critique(wrong_step=wrong, correction=correction, answer=answer, derivation=tuple(step.text for step in steps))
