"""Step-wise arithmetic (``terms`` > 2): the demonstration is a derivation with one step per line, so a
golden negative written that way has a wrong step for the critic to name."""

import pytest

from r3lightning.envs.math_critic import scripted_critique
from r3lightning.envs.math_env import MathSuite
from r3lightning.envs.math_sources import ArithmeticGenerator


def test_two_terms_have_a_one_step_solution():
    item = ArithmeticGenerator(max_operand=9)(7)
    assert item.solution.count("\n") == 0 and item.solution.endswith(f"={item.answer}")


def test_three_terms_give_a_left_to_right_derivation():
    generator = ArithmeticGenerator(max_operand=9, terms=3)
    for seed in range(200):
        item = generator(seed)
        expression = item.question[len("Compute ") : -1]
        assert eval(expression) == int(item.answer) >= 0  # noqa: S307 - a generated "a+b-c"
        steps = item.solution.split("\n")
        assert len(steps) == 2 and steps[-1].endswith(f"={item.answer}")
        first, second = (s.split("=") for s in steps)
        assert eval(first[0]) == int(first[1]) and eval(second[0]) == int(second[1])  # noqa: S307
        assert second[0].startswith(first[1])  # the second step goes on from the first's value


def test_three_terms_refuse_multiplication():
    with pytest.raises(ValueError, match="from '\\+-' only"):
        ArithmeticGenerator(operators="+-*", terms=3)
    with pytest.raises(ValueError, match="terms must be >= 2"):
        ArithmeticGenerator(terms=1)


def test_the_critic_names_the_wrong_step_of_a_stepwise_answer():
    suite = MathSuite(source="arithmetic", source_kwargs={"max_operand": 9, "terms": 3}, num_val_tasks=4,
                      instruction="", demo_style="solution")
    task = next(t for t in (suite.train_task(i) for i in range(50)) if t.data["solution"].count("\n") == 1)
    first, second = task.data["solution"].split("\n")
    lhs, value = first.split("=")
    wrong_value = int(value) + 1
    op_and_operand = second.split("=")[0][len(value):]
    wrong_final = eval(f"{wrong_value}{op_and_operand}")  # noqa: S307
    gnt = f"{lhs}={wrong_value}\n{wrong_value}{op_and_operand}={wrong_final}\n\\boxed{{{wrong_final}}}"
    critique = scripted_critique(task, gnt)
    assert critique.wrong_step == f"{lhs}={wrong_value}"
    assert critique.correction == f"{first}; {second}"
    assert critique.answer == task.answer
    assert suite.demonstration(task) == [f"{task.data['solution']}\n\\boxed{{{task.answer}}}"]


def test_the_reflectrl_recipe_never_trains_on_a_validation_question():
    """The CPU recipe's pool answers training tasks 0..511 (and the validation tasks, for reflective
    validation only): no validation question is among them (stage 2 asks the pool's training questions)."""
    from pathlib import Path

    import yaml

    from r3lightning.cli.reflectrl import build_suite
    from r3lightning.data.reflectrl.gnt_pool import direct_suite

    recipe = Path(__file__).resolve().parents[2] / "configs" / "examples" / "reflectrl_arithmetic_cpu.yaml"
    spec = yaml.safe_load(recipe.read_text())["data"]["suite"]
    spec["init_args"]["pool"] = "unused.jsonl"  # read only when tasks are drawn from the pool
    suite = direct_suite(build_suite(spec))
    val = {t.data["question"] for t in suite.val_tasks()}
    assert len(val) == 128
    train = {suite.train_task(i).data["question"] for i in range(512)}
    assert len(train) > 400 and not train & val
