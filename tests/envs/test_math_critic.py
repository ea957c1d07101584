"""The scripted math critic: exact derivations, the first false step, and declining what it cannot state."""

from fractions import Fraction

import pytest

from r3lightning.envs.base import Task
from r3lightning.envs.math_critic import derivation, find_expression, first_false_claim, format_number, scripted_critique
from r3lightning.envs.math_env import extract_answer


def task(question, answer):
    return Task("t", question, answer, {"question": question})


@pytest.mark.parametrize(
    "question, expression",
    [
        ("Compute 7+3.", "7+3"),
        ("Calculate ( 56 + -33 ) - 84.", "( 56 + -33 ) - 84"),
        ("State the final answer to the following arithmetic problem: 4 - 1 - 7 =", "4 - 1 - 7"),
        ("What is the capital of France?", None),
        ("Compute 7.", None),  # one number is no expression
    ],
)
def test_find_expression(question, expression):
    assert find_expression(question) == expression


def test_derivation_is_exact_and_in_evaluation_order():
    steps = derivation("( 56 + -33 ) - 84")
    assert [s.text for s in steps] == ["56+(-33)=23", "23-84=-61"]
    steps = derivation("-( -( ( 846 - -238 ) / 1084 ) ) / 1 + 176")
    assert steps[-1].value == 177
    assert derivation("7 / 2")[-1].value == Fraction(7, 2) and format_number(Fraction(7, 2)) == "3.5"
    assert format_number(Fraction(1, 3)) == "1/3"
    assert derivation("1 / 0") is None and derivation("__import__('os')") is None


def test_first_false_claim():
    assert first_false_claim("56 + -33 = 23\n23 - 84 = -51\n\\boxed{-51}") == "23-84=-51"
    assert first_false_claim("Compute 7+3. 7+3=11") == "7+3=11"
    assert first_false_claim("7+3=10") is None and first_false_claim("\\boxed{9}") is None


@pytest.mark.parametrize(
    "question, answer, response, wrong, correction",
    [
        ("Compute 7+3.", "10", "\\boxed{9}", "7+3=9", "7+3=10"),  # no written step: the implied claim
        ("Compute 7+3.", "10", "I think 7+3=11\n\\boxed{11}", "7+3=11", "7+3=10"),
        ("Compute 7+3.", "10", "no idea", "no final answer", "7+3=10"),
        ("Calculate ( 56 + -33 ) - 84.", "-61", "56 + -33 = 23\n23 - 84 = -51\n\\boxed{-51}", "23-84=-51", "23-84=-61"),
        ("Calculate ( 56 + -33 ) - 84.", "-61", "\\boxed{5}", "(56+-33)-84=5", "56+(-33)=23; 23-84=-61"),
    ],
)
def test_critique_names_the_wrong_step_and_ends_in_the_right_boxed_answer(question, answer, response, wrong, correction):
    critique = scripted_critique(task(question, answer), response)
    assert (critique.wrong_step, critique.correction, critique.answer) == (wrong, correction, answer)
    assert extract_answer(critique.text) == answer
    assert critique.text.startswith(f"Wrong step: {wrong}\n")


def test_critic_declines_what_it_cannot_state():
    assert scripted_critique(task("Compute 7+3.", "10"), "\\boxed{10}") is None  # the response is right
    assert scripted_critique(task("Compute 7+3.", "11"), "\\boxed{9}") is None  # reference disagrees with the derivation
    assert scripted_critique(task("Name a prime.", "7"), "\\boxed{9}") is None  # no expression
    assert scripted_critique(Task("t", "Compute 1+1.", None, {}), "\\boxed{3}") is None  # no reference


def test_reasoning_gym_questions():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    for name in ("basic_arithmetic", "chain_sum"):
        for entry in reasoning_gym.create_dataset(name, seed=5, size=8):
            question, answer = entry["question"], str(entry["answer"])
            critique = scripted_critique(task(question, answer), "\\boxed{123456789}")
            assert critique is not None, question
            assert extract_answer(critique.text) == format_number(Fraction(answer))
