"""MathEnv / MathSuite: answer extraction, verification under a deadline, sources and splits."""

import os

# Nothing in these tests may touch the network; set before anything imports huggingface_hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json
import sys

import pytest

from r3lightning.envs.base import Environment, Task
from r3lightning.envs.math_env import (
    FEEDBACK_CORRECT,
    FEEDBACK_INCORRECT,
    FEEDBACK_NO_ANSWER,
    MathEnv,
    MathSuite,
    MathVerifier,
    VerifierError,
    extract_answer,
    verify_answer,
)

# A worker that greets, then never answers: stands in for math_verify hanging on adversarial input.
HANGING_WORKER = [
    sys.executable,
    "-c",
    "import sys, time; print('{\"ready\": true}', flush=True); sys.stdin.readline(); time.sleep(600)",
]
CRASHING_WORKER = [sys.executable, "-c", "import sys; print('{\"ready\": true}', flush=True); sys.stdin.readline()"]
SILENT_WORKER = [sys.executable, "-c", "import time; time.sleep(600)"]


class ForbiddenVerifier:
    """Fails the test if the slow path is taken."""

    def verify(self, predicted, reference, timeout_s):
        raise AssertionError(f"fast path expected for {predicted!r} vs {reference!r}")


class BrokenVerifier:
    def verify(self, predicted, reference, timeout_s):
        raise VerifierError("boom")


@pytest.fixture(scope="module")
def real_verifier():
    verifier = MathVerifier()
    yield verifier
    verifier.close()


def task(answer, prompt="Compute 7+12."):
    return Task(task_id="t", prompt=prompt, answer=answer)


# ------------------------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the result is \\boxed{19}.", "19"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\sqrt{\\frac{a}{b^{2}}}}", "\\sqrt{\\frac{a}{b^{2}}}"),
        ("first \\boxed{1} then \\boxed{2} finally \\boxed{3}", "3"),
        ("\\boxed{  42 \n}", "42"),
        ("\\boxed {7}", "7"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{5} and a cut-off \\boxed{\\frac{1}{", "5"),
        ("\\boxed{4} then an empty \\boxed{ }", "4"),
        ("\\boxed{\\boxed{9}}", "9"),
        ("<answer> 12 </answer>", "12"),
        ("<answer>1</answer> <answer>\n2\n</answer>", "2"),
        ("<answer>8</answer> but \\boxed{9}", "9"),
        ("work...\nAnswer: 15\n", "15"),
        ("  answer: 3\nANSWER:   4  ", "4"),
        ("The answer: is not at line start", None),
        ("I think it is 19", None),
        ("", None),
        ("   \n ", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------------------------- verification


@pytest.mark.parametrize(
    "predicted, reference, expected",
    [("19", "19", True), (" 19 ", "$19$.", True), ("+5", "5", True), ("3", "4", False), ("x + 1", "x+1", True)],
)
def test_verify_fast_path_skips_math_verify(predicted, reference, expected):
    assert verify_answer(predicted, reference, verifier=ForbiddenVerifier()) is expected


@pytest.mark.parametrize(
    "predicted, reference, expected",
    [
        ("\\frac{1}{2}", "0.5", True),
        ("(x+1)^2", "x^2+2x+1", True),
        ("\\{2, 1\\}", "\\{1, 2\\}", True),
        ("2^{n-2}", "2^(n-1)", False),
        ("banana", "4", False),
        ("1/3", "2/3", False),
    ],
)
def test_verify_with_math_verify(real_verifier, predicted, reference, expected):
    assert verify_answer(predicted, reference, verifier=real_verifier) is expected


def test_real_math_verify_hang_is_cut_and_worker_restarts(real_verifier):
    # A power tower sympy tries to evaluate in C; signal-based timeouts cannot interrupt it.
    try:
        assert verify_answer("9^{9^{9^{9}}}", "2", timeout_s=1.0, verifier=real_verifier) is False
    except VerifierError:
        pass
    assert verify_answer("\\frac{1}{2}", "0.5", verifier=real_verifier) is True


def test_hanging_verifier_is_cut_at_the_deadline():
    verifier = MathVerifier(command=HANGING_WORKER)
    try:
        with pytest.raises(VerifierError, match="timed out"):
            verifier.verify("1/2", "0.5", timeout_s=0.5)
        assert verifier._process is None  # the hung worker was killed, the next call starts afresh
        with pytest.raises(VerifierError):
            verifier.verify("1/2", "0.5", timeout_s=0.2)
    finally:
        verifier.close()


def test_crashing_and_silent_workers_raise_verifier_error():
    crashing = MathVerifier(command=CRASHING_WORKER)
    with pytest.raises(VerifierError, match="exited"):
        crashing.verify("1/2", "0.5", timeout_s=5.0)
    silent = MathVerifier(command=SILENT_WORKER, startup_timeout_s=0.3)
    with pytest.raises(VerifierError, match="startup timed out"):
        silent.verify("1/2", "0.5", timeout_s=5.0)


# --------------------------------------------------------------------------------------- MathEnv


def test_env_correct_answer():
    env = MathEnv(verifier=ForbiddenVerifier())
    assert isinstance(env, Environment)
    assert env.reset(task("19")) == "Compute 7+12."
    result = env.step("7+12 = 19, so \\boxed{19}")
    assert (result.reward, result.done, result.feedback) == (1.0, True, FEEDBACK_CORRECT)
    assert result.info["success"] is True and result.info["reward_error"] is False


def test_env_wrong_and_empty_answers_end_single_attempt_episode():
    env = MathEnv(verifier=ForbiddenVerifier())
    env.reset(task("19"))
    result = env.step("\\boxed{20}")
    assert (result.reward, result.done, result.feedback) == (0.0, True, FEEDBACK_INCORRECT)
    assert result.info["success"] is False
    env.reset(task("19"))
    result = env.step("")
    assert (result.reward, result.done, result.feedback) == (0.0, True, FEEDBACK_NO_ANSWER)
    assert result.info["reward_error"] is False
    with pytest.raises(RuntimeError, match="reset"):
        env.step("\\boxed{19}")


def test_env_multi_attempt_retries_until_correct_or_out_of_attempts():
    env = MathEnv(max_attempts=3, verifier=ForbiddenVerifier())
    env.reset(task("19"))
    first, second, third = env.step("\\boxed{18}"), env.step("no idea"), env.step("Answer: 19")
    assert (first.done, first.reward, first.observation) == (False, 0.0, FEEDBACK_INCORRECT)
    assert (second.done, second.feedback) == (False, FEEDBACK_NO_ANSWER)
    assert (third.done, third.reward, third.info["success"], third.info["attempt"]) == (True, 1.0, True, 3)
    env.reset(task("19"))
    results = [env.step("\\boxed{1}") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == 0.0 and results[-1].info["success"] is False


def test_env_marks_verifier_timeout_as_reward_error():
    verifier = MathVerifier(command=HANGING_WORKER)
    try:
        env = MathEnv(max_attempts=2, verify_timeout_s=0.5, verifier=verifier)
        env.reset(task("0.5"))
        result = env.step("\\boxed{\\frac{1}{2}}")
        assert (result.reward, result.done, result.info["success"]) == (0.0, True, False)
        assert result.info["reward_error"] is True
    finally:
        verifier.close()
    env = MathEnv(verifier=BrokenVerifier())
    env.reset(task("0.5"))
    assert env.step("\\boxed{1/2}").info["reward_error"] is True


# ------------------------------------------------------------------------------------- MathSuite


def test_arithmetic_suite_prompts_answers_and_determinism():
    suite = MathSuite(source="arithmetic", num_val_tasks=16, seed=3)
    tasks = [suite.train_task(i) for i in range(50)]
    for t in tasks:
        question = t.data["question"]
        assert t.prompt == question + "\nPut your final answer in \\boxed{}."
        assert question.startswith("Compute ") and question.endswith(".")
        assert int(t.answer) == eval(question[len("Compute ") : -1]) >= 0
    assert [t.prompt for t in tasks] == [MathSuite(num_val_tasks=16, seed=3).train_task(i).prompt for i in range(50)]
    assert [t.prompt for t in tasks] != [MathSuite(num_val_tasks=16, seed=4).train_task(i).prompt for i in range(50)]
    # A task is its question: a problem drawn twice has one task id (replay and outcome history key on it).
    assert len({t.task_id for t in tasks}) == len({t.prompt for t in tasks})
    assert all((a.task_id == b.task_id) == (a.prompt == b.prompt) for a in tasks for b in tasks)
    assert suite.max_turns == 1 and suite.system_prompt


def test_arithmetic_validation_is_disjoint_from_training():
    suite = MathSuite(source="arithmetic", source_kwargs={"max_operand": 5, "operators": "+"}, num_val_tasks=10)
    val_questions = {t.data["question"] for t in suite.val_tasks()}
    assert len(val_questions) == 10
    train_questions = {suite.train_task(i).data["question"] for i in range(300)}
    assert not val_questions & train_questions
    assert len(train_questions) == 36 - 10  # every non-held-out problem of the 6x6 space shows up
    with pytest.raises(ValueError, match="distinct problems"):
        MathSuite(source="arithmetic", source_kwargs={"max_operand": 1, "operators": "+"}, num_val_tasks=10)


def test_arithmetic_demonstrations_solve_their_tasks():
    suite = MathSuite(source="arithmetic", source_kwargs={"operators": "+-*"}, num_val_tasks=4)
    solution_suite = MathSuite(source="arithmetic", num_val_tasks=4, demo_style="solution")
    for index in range(20):
        t = suite.train_task(index)
        env = suite.make_env()
        env.reset(t)
        assert suite.demonstration(t) == [f"\\boxed{{{t.answer}}}"]
        assert env.step(suite.demonstration(t)[0]).reward == 1.0
    t = solution_suite.train_task(0)
    assert solution_suite.demonstration(t) == [f"{t.data['solution']}\n\\boxed{{{t.answer}}}"]
    assert t.data["solution"].endswith(f"={t.answer}")


def test_arithmetic_bad_kwargs():
    with pytest.raises(ValueError, match="operators"):
        MathSuite(source="arithmetic", source_kwargs={"operators": "/"})
    with pytest.raises(ValueError, match="source_kwargs"):
        MathSuite(source="arithmetic", source_kwargs={"difficulty": 3})


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    return path


def test_jsonl_suite_holds_out_rows_and_shuffles_each_epoch(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i), "steps": f"s{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    suite = MathSuite(source=f"jsonl:{path}", num_val_tasks=3, seed=1, instruction="")
    val_ids = {t.task_id for t in suite.val_tasks()}
    epochs = [[suite.train_task(e * 7 + i).task_id for i in range(7)] for e in range(3)]
    assert len(val_ids) == 3
    for epoch in epochs:
        assert len(set(epoch)) == 7 and not set(epoch) & val_ids
    assert epochs[0] != epochs[1] and set(epochs[0]) == set(epochs[1])
    t = suite.train_task(0)
    assert t.prompt == t.data["question"] and t.answer == t.prompt[1:]
    assert MathSuite(source=f"jsonl:{path}", num_val_tasks=3, seed=1).train_task(5).task_id == epochs[0][5]
    solutions = MathSuite(source=f"jsonl:{path}", num_val_tasks=3, solution_field="steps", demo_style="solution")
    t = solutions.train_task(0)
    assert solutions.demonstration(t) == [f"s{t.answer}\n\\boxed{{{t.answer}}}"]


def test_parquet_suite_with_custom_fields(tmp_path):
    import pyarrow
    import pyarrow.parquet

    path = tmp_path / "data.parquet"
    table = pyarrow.table({"problem": ["1+1?", "2+2?", "3+3?"], "final": [2, 4, 6]})
    pyarrow.parquet.write_table(table, path)
    suite = MathSuite(source=f"parquet:{path}", question_field="problem", answer_field="final", num_val_tasks=1)
    tasks = suite.val_tasks() + [suite.train_task(i) for i in range(2)]
    assert sorted((t.data["question"], t.answer) for t in tasks) == [("1+1?", "2"), ("2+2?", "4"), ("3+3?", "6")]


def test_dataset_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        MathSuite(source=f"jsonl:{missing}")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "1"}, {"question": "b"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 2 has no 'answer' field"):
        MathSuite(source=f"jsonl:{bad}", num_val_tasks=0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        MathSuite(source=f"jsonl:{empty}", num_val_tasks=0)
    small = write_jsonl(tmp_path / "small.jsonl", [{"question": "a", "answer": "1"}])
    with pytest.raises(ValueError, match="no training rows"):
        MathSuite(source=f"jsonl:{small}", num_val_tasks=1)
    with pytest.raises(ValueError, match="provides no solutions"):
        MathSuite(source=f"jsonl:{small}", num_val_tasks=0, demo_style="solution")
    with pytest.raises(ValueError, match=r"valid sources: .*jsonl:<path>"):
        MathSuite(source="csv:data.csv")
    with pytest.raises(ValueError, match="valid sources"):
        MathSuite(source="jsonl:")


def test_hf_source_offline_raises_clear_error():
    with pytest.raises(ValueError, match="r3lightning-test/missing.*network access or a cached copy"):
        MathSuite(source="hf:r3lightning-test/missing")


def test_champ_source():
    suite = MathSuite(source="champ", num_val_tasks=20, demo_style="solution")
    val = suite.val_tasks()
    assert len(val) == 20 and all(t.task_id.startswith("champ#P_") and t.answer for t in val)
    train_ids = {suite.train_task(i).task_id for i in range(250)}
    assert len(train_ids) == 250 and not train_ids & {t.task_id for t in val}
    t = suite.train_task(0)
    assert suite.demonstration(t)[0].endswith(f"\\boxed{{{t.answer}}}") and t.data["solution"]


def test_reasoning_gym_source():
    kwargs = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    suite = MathSuite(source="reasoning_gym:basic_arithmetic", source_kwargs=kwargs, num_val_tasks=5)
    t = suite.train_task(7)
    assert t.prompt.startswith("Calculate ") and t.answer.lstrip("-").isdigit()
    assert MathSuite(source="reasoning_gym:basic_arithmetic", source_kwargs=kwargs, num_val_tasks=5).train_task(7) == t
    with pytest.raises(ValueError, match="not registered"):
        MathSuite(source="reasoning_gym:no_such_generator")
    with pytest.raises(ValueError, match="source_kwargs"):
        MathSuite(source="reasoning_gym:basic_arithmetic", source_kwargs={"bogus": 1})


def test_suite_arguments_are_documented_for_jsonargparse():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(MathSuite, "suite")
    help_text = parser.format_help()
    assert "max_operand" in help_text and "seeded by" in help_text
    config = parser.parse_args(["--suite.source=arithmetic", "--suite.max_attempts=2"])
    assert config.suite.max_attempts == 2


# ---- final_answer: last_number (a model told to answer with the number only) -------------------------
def test_the_last_number_is_the_answer_of_a_number_only_reply():
    from r3lightning.envs.math_env import extract_last_number

    assert extract_last_number("7 + 12 = 19") == "19"
    assert extract_last_number("It is -4, not 3.") == "3"
    assert extract_last_number("about 1,234.5 apples") == "1234.5"
    assert extract_last_number("-7") == "-7"
    assert extract_last_number("Thirty-two!") is None


def test_a_last_number_suite_reads_bare_answers_and_demonstrates_them_bare():
    from r3lightning.envs.math_env import FEEDBACK_NO_NUMBER, MathSuite

    suite = MathSuite(source_kwargs={"max_operand": 20, "operators": "+"}, num_val_tasks=2,
                      instruction="Answer with the number only.", final_answer="last_number")
    task = suite.train_task(0)
    assert suite.demonstration(task) == [str(task.answer)]
    assert FEEDBACK_NO_NUMBER in suite.feedback_texts()
    env = suite.make_env()
    env.reset(task)
    assert env.step(f"The sum is {task.answer}").reward == 1.0
    env.reset(task)
    result = env.step("I cannot say.")
    assert result.reward == 0.0 and result.info["feedback"] == FEEDBACK_NO_NUMBER and result.info["invalid_action"]
    with pytest.raises(ValueError, match="final_answer must be one of boxed, last_number"):
        MathSuite(final_answer="first_number")
