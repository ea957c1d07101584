"""Validation through the module: greedy pass@1, pass@k (unbiased estimator) and mean@n over
``data.val_samples`` sampled episodes per task, against hand-computed values, with a scripted engine so
that the correctness of every sample is known; the JSON and markdown files of each validation."""

import json
import re

import lightning as L
import pytest
import torch
from harness import ARITHMETIC, module_and_data, quiet_trainer
from scripted_engine import ScriptedEngine

from r3lightning.callbacks.phase_report import PhaseReport
from r3lightning.data.evaluation import pass_ks, validation_figures, validation_names
from r3lightning.envs.math_env import MathSuite
from r3lightning.types import Trajectory, Turn

# Per validation task (in val_tasks order): is sample i correct? The greedy episode is correct for the
# first two tasks only. Task 2 never succeeds, task 3 always does.
SAMPLES = {
    3: [[1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1]],
    4: [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]],
}
GREEDY = [1, 1, 0, 0]
# pass@k = 1 - C(n - c, k) / C(n, k), averaged over the 4 tasks (c = correct samples of a task):
#   n = 3, c = 1, 2, 0, 3: pass@1 = (1/3 + 2/3 + 0 + 1) / 4; pass@2 = (1 - 1/3, 1 - 0/3, 0, 1) / 4; pass@3 = 3/4
#   n = 4, c = 1, 2, 0, 4: pass@2 = (1 - 3/6, 1 - 1/6, 0, 1) / 4; pass@4 = 3/4
EXPECTED = {
    3: {"pass@1": 0.5, "pass@2": (2 / 3 + 1 + 0 + 1) / 4, "pass@3": 0.75, "mean@3": 0.5},
    4: {"pass@1": 7 / 16, "pass@2": (0.5 + 5 / 6 + 0 + 1) / 4, "pass@4": 0.75, "mean@4": 7 / 16},
}


class CountingEngine(ScriptedEngine):
    """Answers task j's i-th sampled episode right when ``samples[j][i]``, its greedy episode right
    when ``GREEDY[j]``; wrong answers are one too many."""

    def __init__(self, tokenizer, questions, samples):
        super().__init__(tokenizer, reply=None)
        self.questions, self.samples = questions, samples
        self.seen = [0] * len(questions)
        self.temperatures = []

    def generate(self, prompts, params):
        self.temperatures.append(params.temperature)
        self.reply = lambda text: self.answer(text, params.greedy)
        return super().generate(prompts, params)

    def answer(self, text, greedy):
        a, op, b = re.search(r"Compute (\d+)([+-])(\d+)", text).groups()
        j = self.questions.index((a, op, b))
        if greedy:
            right = GREEDY[j]
        else:
            right = self.samples[j][self.seen[j]]
            self.seen[j] += 1
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        return f"\\boxed{{{value if right else value + 1}}}"


def questions_of(suite):
    return [re.search(r"Compute (\d+)([+-])(\d+)", t.prompt).groups() for t in suite.val_tasks()]


class SwapEngine(L.Callback):
    def __init__(self, make):
        self.make, self.engine = make, None

    def on_validation_start(self, trainer, module):
        self.engine = self.make(module.tokenizer)
        module.use_engine(self.engine)


@pytest.mark.parametrize("n", [3, 4])
def test_pass_at_k_through_validation_matches_hand_computed(tmp_path, n):
    suite = MathSuite(**ARITHMETIC)
    questions = questions_of(suite)
    assert len(set(questions)) == 4
    module, dm = module_and_data(suite)
    dm.val_samples = n
    dm.val_tasks_per_batch = 3  # batches of 3 and 1 tasks: the batches are weighted by their tasks
    swap = SwapEngine(lambda tokenizer: CountingEngine(tokenizer, questions, SAMPLES[n]))
    report = PhaseReport()
    trainer = quiet_trainer(1, limit_val_batches=None, callbacks=[swap, report], default_root_dir=str(tmp_path))
    [logged] = trainer.validate(module, dm, verbose=False)

    assert swap.engine.seen == [n] * 4  # every task sampled n times, greedy once (not counted)
    assert sorted(set(swap.engine.temperatures)) == [0.0, dm.val_sampling.temperature]
    expected = {f"val/{k}": v for k, v in EXPECTED[n].items()}
    expected.update({"val/success_rate_greedy": 0.5, "val/success_rate": EXPECTED[n]["pass@1"]})
    assert set(logged) == {f"val/{name}" for name in validation_names(n)}
    for tag, value in expected.items():
        assert logged[tag] == pytest.approx(value, abs=1e-6), tag
    assert logged["val/reward_mean"] == pytest.approx(EXPECTED[n]["pass@1"], abs=1e-6)  # reward 1 for a right answer
    assert logged["val/truncated_rate"] == 0.0 and logged["val/truncated_rate_greedy"] == 0.0

    # The report of this validation, next to the logs (here the root directory: no logger).
    report_file = json.loads((tmp_path / "validation_step0.json").read_text())
    assert (report_file["suite"], report_file["tasks"], report_file["samples_per_task"]) == ("MathSuite", 4, n)
    assert report_file["metrics"]["val/pass@2"] == pytest.approx(EXPECTED[n]["pass@2"], abs=1e-6)
    table = (tmp_path / "validation_step0.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| MathSuite"))
    assert f"| {100 * EXPECTED[n][f'pass@{n}']:.1f}% |" in row and "| 50.0% |" in row


def test_sampled_validation_episodes_are_reproducible():
    """Two validations with the same weights sample the same episodes (the datamodule seeds them),
    and the samples of one task differ from each other."""
    module, dm = module_and_data(max_new_tokens=6)
    dm.val_samples = 4
    trainer = quiet_trainer(1, limit_val_batches=None)
    trainer.validate(module, dm, verbose=False)
    tasks = dm.suite.val_tasks()
    torch.manual_seed(123)  # the global stream does not matter
    first = [t.token_ids() for t in dm.evaluate(tasks, greedy=False, samples=4)]
    torch.manual_seed(456)
    second = [t.token_ids() for t in dm.evaluate(tasks, greedy=False, samples=4)]
    assert first == second
    assert len(first) == 4 * len(tasks)
    assert len({tuple(ids) for ids in first[:4]}) > 1


def trajectory(success, tokens, truncated=False, reward=None):
    turn = Turn(context_ids=[1, 2], response_ids=list(range(tokens)))
    return Trajectory("t", [turn], reward=float(success) if reward is None else reward, success=success, truncated=truncated)


def test_validation_figures_by_hand():
    greedy = [trajectory(True, 4), trajectory(False, 8, truncated=True)]
    sampled = [trajectory(True, 2), trajectory(False, 6, truncated=True, reward=0.5), trajectory(False, 3), trajectory(False, 5)]
    figures = validation_figures(greedy, sampled, samples=2)
    assert figures == pytest.approx(
        {
            "success_rate_greedy": 0.5,
            "response_len_greedy": 6.0,
            "truncated_rate_greedy": 0.5,
            "success_rate": 0.25,
            "reward_mean": 0.375,
            "response_len": 4.0,
            "truncated_rate": 0.25,
            "pass@1": 0.25,
            "pass@2": 0.5,  # task 0: 1 of 2 correct, pass@2 = 1; task 1: none
            "mean@2": 0.25,
        }
    )
    assert list(figures) == validation_names(2)
    with pytest.raises(ValueError, match="3 sampled episodes for 2 tasks x 2 samples"):
        validation_figures(greedy, sampled[:3], samples=2)


def test_pass_ks_are_powers_of_two_and_n():
    assert pass_ks(1) == [1]
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="data.val_samples"):
        pass_ks(0)
