"""benchmarks/comparison_speed.py: two runs' logs are equal when every scalar but the machine's
measures is, and a difference names its tag, step and both values."""

from torch.utils.tensorboard import SummaryWriter

from benchmarks.comparison_speed import measures_the_machine, scalar_differences


def write_run(path, series: dict[str, list[float]]) -> str:
    writer = SummaryWriter(str(path))
    for tag, values in series.items():
        for step, value in enumerate(values):
            writer.add_scalar(tag, value, step)
    writer.close()
    return str(path)


def test_the_machines_measures_are_left_out():
    assert [measures_the_machine(t) for t in ("time/step_s", "memory/peak_rss_gb", "perf/rollout_tokens_per_s",
                                              "perf/hf_fused_compile_s", "perf/prefix_cache_hit_rate", "train/loss")] == [
        True, True, True, True, False, False]


def test_runs_that_differ_only_in_wall_time_are_equal(tmp_path):
    first = write_run(tmp_path / "a", {"train/loss": [1.0, 0.5], "time/step_s": [0.1, 0.2]})
    second = write_run(tmp_path / "b", {"train/loss": [1.0, 0.5], "time/step_s": [3.0, 4.0]})
    assert scalar_differences(first, second) == {"tags_compared": 1, "points_compared": 2, "differing": {}}


def test_a_difference_names_its_tag_step_and_values(tmp_path):
    first = write_run(tmp_path / "a", {"train/loss": [1.0, 0.5], "val/success_rate": [0.25]})
    second = write_run(tmp_path / "b", {"train/loss": [1.0, 0.75]})
    assert scalar_differences(first, second)["differing"] == {
        "train/loss": {"step": 1, "values": [0.5, 0.75]},
        "val/success_rate": "logged by one run only",
    }
