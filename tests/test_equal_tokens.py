"""experiments.equal_tokens: the token axis, the interpolation and the pairing, against hand-computed values."""

import pytest

from experiments.equal_tokens import compare, cumulative_at, interpolate, paired


def test_tokens_at_a_validation_are_those_of_the_steps_before_it():
    per_step = [(0, 100.0), (1, 200.0), (2, 300.0), (3, 400.0)]
    assert cumulative_at(per_step, [0, 2, 4]) == [0.0, 300.0, 1000.0]


def test_interpolation_is_linear_between_validations_and_none_outside():
    assert interpolate(150.0, [0.0, 100.0, 300.0], [0.2, 0.4, 0.8]) == pytest.approx(0.5)
    assert interpolate(100.0, [0.0, 100.0, 300.0], [0.2, 0.4, 0.8]) == pytest.approx(0.4)
    assert interpolate(301.0, [0.0, 100.0, 300.0], [0.2, 0.4, 0.8]) is None


def run(steps, greedy, tokens):
    return {"steps": steps, "greedy": greedy, "sampled": greedy, "tokens": tokens, "step_seconds": [0.0] * len(steps)}


def test_the_tested_arm_is_read_against_the_baseline_at_its_own_token_counts_and_steps():
    # baseline: 1000 tokens a step; tested: 2000 tokens a step, so its step 8 meets the baseline's step 16
    baseline = run([0, 8, 16], [0.3, 0.5, 0.7], [0.0, 8000.0, 16000.0])
    tested = run([0, 8], [0.3, 0.6], [0.0, 16000.0])
    at_tokens = paired(baseline, tested, "tokens", "greedy")
    assert at_tokens == [{"tokens": 16000.0, "tested": 0.6, "baseline": 0.7, "difference": pytest.approx(-0.1)}]
    at_steps = paired(baseline, tested, "steps", "greedy")
    assert at_steps[0]["baseline"] == 0.5 and at_steps[0]["difference"] == pytest.approx(0.1)
    figures = compare({"grpo": {0: baseline, 1: baseline}, "r3l": {0: tested, 1: run([0, 8], [0.3, 0.8], [0.0, 12000.0])}},
                      "grpo", "r3l", [0, 1])
    # seed 1: 12000 tokens lie between the baseline's 8000 (0.5) and 16000 (0.7): 0.6, difference +0.2
    last = figures["last_greedy_difference_at_equal_tokens"]
    assert last["per_seed"] == [pytest.approx(-0.1), pytest.approx(0.2)] and last["mean"] == pytest.approx(0.05)
    assert figures["r3l_final"]["generated_tokens"] == [16000.0, 12000.0]
    assert figures["final_greedy_difference"]["per_seed"] == [pytest.approx(-0.1), pytest.approx(0.1)]
    assert figures["final_tokens_ratio"]["per_seed"] == [1.0, 0.75]


def test_a_per_step_figure_is_summarized_by_its_first_and_last_quarter():
    from experiments.equal_tokens import quarters

    assert quarters([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) == {"first_quarter": 1.5, "last_quarter": 7.5, "steps": 8}
    assert quarters([0.5, 0.25]) == {"first_quarter": 0.5, "last_quarter": 0.25, "steps": 2}
