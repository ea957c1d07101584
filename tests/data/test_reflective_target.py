"""ReflectRL's format-matched reflective target (``r3l reflect-sft --target solution``): the reflective row's
target is the corrected answer written exactly as a direct answer is, so the context-distillation teacher,
asked under the reflective prompt, writes what the direct student writes (issue 62: with the critique
target its KL pulled direct answers toward ``Wrong step: / Correction:``)."""

import pytest

from r3lightning.cli.reflectrl import reflect_sft_main
from r3lightning.data.reflectrl.reflective_sft import resolve_candidate, resolve_critique
from r3lightning.envs.base import TaskSuite
from r3lightning.envs.math_critic import scripted_critique
from r3lightning.envs.math_env import MathSuite
from r3lightning.envs.reflective import scripted_critic


def stepwise_suite():
    return MathSuite(source="arithmetic", source_kwargs={"max_operand": 9, "terms": 3}, num_val_tasks=4,
                     instruction="", demo_style="solution")


def two_step_task(suite):
    return next(t for t in (suite.train_task(i) for i in range(50)) if t.data["solution"].count("\n") == 1)


def test_the_oracle_solution_target_is_the_direct_demonstration_whichever_step_was_wrong():
    suite = stepwise_suite()
    task = two_step_task(suite)
    first, second = task.data["solution"].split("\n")
    lhs, value = first.split("=")
    op_and_operand = second.split("=")[0][len(value):]
    # The first step wrong (and the second carried on from it), then only the second step wrong.
    wrong_first = f"{lhs}={int(value) + 1}\n{int(value) + 1}{op_and_operand}=0\n\\boxed{{0}}"
    wrong_second = f"{first}\n{value}{op_and_operand}=99\n\\boxed{{99}}"
    direct = suite.demonstration(task)[0]
    for gnt in (wrong_first, wrong_second):
        critique = scripted_critique(task, gnt)
        assert critique.text.startswith("Wrong step:")  # the critique target is not a direct answer
        assert critique.solution == direct
        assert scripted_critic(suite, "solution")(task, gnt) == direct
        assert scripted_critic(suite, "critique")(task, gnt) == critique.text


def test_the_resolve_solution_target_is_the_re_solved_answer():
    gnt = "7+3=11\n11-2=9\n\\boxed{9}"
    solution = "7+3=10\n10-2=8\n\\boxed{8}\n"
    assert resolve_candidate(gnt, solution, "solution") == "7+3=10\n10-2=8\n\\boxed{8}"
    assert resolve_candidate(gnt, solution, "critique") == resolve_critique(gnt, solution) == (
        "Wrong step: 7+3=11\nCorrection: 7+3=10; 10-2=8\n\\boxed{8}"
    )
    assert resolve_candidate(gnt, "7+3=10", "solution") is None  # no final answer: no target
    with pytest.raises(ValueError, match="reflective target"):
        resolve_candidate(gnt, solution, "prose")


def test_a_suite_without_a_scripted_solution_has_no_solution_critic():
    class Own(TaskSuite):  # a suite with its own critique but no scripted solution
        system_prompt, max_turns = "", 1

        def make_env(self):
            raise NotImplementedError

        def train_task(self, index):
            raise NotImplementedError

        def val_tasks(self):
            return []

        def demonstration(self, task):
            return None

        def scripted_critique(self, task, response):
            return "Wrong step: all\nCorrection: 1\n\\boxed{1}"

    assert scripted_critic(Own(), "critique") is not None
    assert scripted_critic(Own(), "solution") is None


def test_the_model_critic_is_refused_with_the_solution_target():
    with pytest.raises(ValueError, match="--target solution: the model critic writes its own format"):
        reflect_sft_main(["--config", "unread.yaml", "--pool", "unread.jsonl", "--out", "x.jsonl", "--critic", "model",
                          "--target", "solution"])


def number_only_suite():
    return MathSuite(source="arithmetic", source_kwargs={"max_operand": 20, "operators": "+"}, num_val_tasks=4,
                     instruction="Answer with the number only.", final_answer="last_number")


def test_a_number_only_suite_s_critic_reads_the_last_number_and_its_solution_target_is_the_bare_number():
    # The real-model recipe's task: before, the critic read a GNT such as "32" with \boxed{} and wrote
    # "no final answer", and the solution target carried a boxed line the student never writes.
    suite = number_only_suite()
    task = suite.train_task(0)
    left, right = task.data["question"].split("Compute ")[1].rstrip(".").split("+")
    wrong = int(task.answer) + 1
    critique = scripted_critic(suite, "critique")(task, f"{left} + {right} = {wrong}")
    assert critique.startswith(f"Wrong step: {left}+{right}={wrong}\n") and critique.endswith(f"\\boxed{{{task.answer}}}")
    assert scripted_critic(suite, "critique")(task, str(wrong)).startswith(f"Wrong step: {left}+{right}={wrong}\n")
    assert scripted_critic(suite, "solution")(task, str(wrong)) == suite.demonstration(task)[0] == str(task.answer)
    assert scripted_critic(suite, "solution")(task, str(task.answer)) is None  # a right answer has no critique


def test_the_resolve_critic_reads_a_number_only_answer_with_the_suite_s_reader():
    from r3lightning.data.reflectrl.reflective_sft import answer_reader

    read = answer_reader(number_only_suite())
    assert resolve_candidate("32", " 42\n", "solution", read) == "42"
    assert resolve_candidate("32", "no idea", "solution", read) is None
    assert resolve_candidate("32", "42", "solution") is None  # the boxed reader finds no answer in "42"
    assert answer_reader(stepwise_suite())("\\boxed{8}") == "8"
