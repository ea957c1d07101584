"""benchmarks/recipe_run.py: the scalars it reads back from TensorBoard and its step-time split."""

import pytest
from torch.utils.tensorboard import SummaryWriter

from benchmarks.recipe_run import scalars, step_split


def test_scalars_come_back_per_tag_in_step_order(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    for step, value in ((2, 0.5), (0, 1.5), (1, 2.5)):
        writer.add_scalar("time/step_s", value, step)
    writer.add_scalar("rollout/generated_tokens", 64.0, 0)
    writer.close()
    assert scalars(str(tmp_path)) == {"time/step_s": [(0, 1.5), (1, 2.5), (2, 0.5)], "rollout/generated_tokens": [(0, 64.0)]}


def test_step_split_is_medians_and_the_rest():
    series = {"time/step_s": [(0, 3.0), (1, 5.0), (2, 4.0)], "time/rollout_s": [(0, 2.0), (1, 2.5), (2, 3.0)],
              "time/train_s": [(0, 0.5), (1, 1.0), (2, 0.75)]}
    assert step_split(series) == pytest.approx(
        {"time/step_s_median": 4.0, "time/rollout_s_median": 2.5, "time/train_s_median": 0.75, "time/other_s_median": 0.75})
    # Without all three there is no "other".
    assert step_split({"time/step_s": [(0, 3.0)]}) == {"time/step_s_median": 3.0}
