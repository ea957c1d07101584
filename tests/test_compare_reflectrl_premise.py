"""``experiments.compare_reflectrl`` reports every arm's teacher premise, refused runs included: a
context-distillation arm whose teacher was not better is refused under strict health, and its premise
figures (read back from the refusal) are the arm's result (issue 62's format-matched target arm)."""

import math

from experiments.compare_reflectrl import premise_figures, teacher_premise_gain

# A refusal as r3lightning.training.distillation words it (copied from a run's comparison JSON).
REFUSAL = ("health.strict: [r3lightning] ReflectRL premise: the teacher (stage-1 policy) answers 18.5% of 124 validation "
           "questions with a golden negative in its prompt and 26.6% without (gain -8.1 ± 3.9 points, standard error, "
           "greedy): not better, so the context-distillation teacher has no reflective skill to transfer")


def test_the_premise_gain_is_read_from_a_refusal_or_from_the_recorded_premise():
    assert math.isclose(teacher_premise_gain({"refused": REFUSAL}), -0.081)
    assert math.isclose(teacher_premise_gain({"refused": REFUSAL.replace("-8.1", "+3.1")}), 0.031)
    assert teacher_premise_gain({"refused": "health.strict: R³L success judgments is switched on but inert"}) is None
    assert teacher_premise_gain({"teacher_premise": {"gain": 0.03}}) == 0.03
    assert teacher_premise_gain({"student_direct_greedy": 0.5}) is None  # an anchor arm measures none


def test_each_arm_s_premise_gain_is_paired_against_reflectrl_s_on_the_same_seeds():
    runs = {
        "reflectrl_grpo": {"0": {"refused": REFUSAL}, "1": {"teacher_premise": {"gain": -0.10}}},
        "reflectrl_solution_grpo": {"0": {"teacher_premise": {"gain": 0.019}}, "1": {"refused": REFUSAL.replace("-8.1", "-2.0")}},
        "gtplus_grpo": {"0": {"student_direct_greedy": 0.5}},
    }
    figures = premise_figures(runs)
    assert figures["reflectrl_solution_grpo/teacher_premise_gain_per_seed"] == {"0": 0.019, "1": -0.02}
    assert math.isclose(figures["reflectrl_grpo/teacher_premise_gain_mean"], -0.0905)
    assert math.isclose(figures["reflectrl_grpo/teacher_premise_gain_se"], 0.0095)  # sd 0.01344 / sqrt(2)
    assert math.isclose(figures["reflectrl_solution_grpo/teacher_premise_gain_minus_reflectrl_mean"], (0.100 + 0.080) / 2)
    assert math.isclose(figures["reflectrl_solution_grpo/teacher_premise_gain_minus_reflectrl_se"], 0.01)
    assert "reflectrl_grpo/teacher_premise_gain_minus_reflectrl_mean" not in figures
    assert "gtplus_grpo/teacher_premise_gain_mean" not in figures
