"""``scripts.gather_scalars``: named scalars of each run's newest log version, warm-starts skipped."""

from torch.utils.tensorboard import SummaryWriter

from scripts.gather_scalars import gather


def log(folder, values):
    writer = SummaryWriter(str(folder))
    for step, value in enumerate(values):
        writer.add_scalar("rollout/x", value, step)
    writer.close()


def test_gather_reads_the_newest_version_of_each_run_and_skips_warm_starts(tmp_path):
    log(tmp_path / "r3l_seed0" / "version_0", [9.0])
    log(tmp_path / "r3l_seed0" / "version_10", [1.0, 2.0, 3.0, 4.0, 6.0])  # newest: 10 > 0, not "1" < "9"
    log(tmp_path / "r3l_seed0" / "version_9", [7.0])
    log(tmp_path / "grpo_seed0" / "version_0", [5.0])
    log(tmp_path / "warmstart_seed0" / "version_0", [8.0])
    figures = gather(str(tmp_path), ["rollout/x", "rollout/never_logged"])
    assert set(figures) == {"r3l_seed0", "grpo_seed0"}
    assert figures["r3l_seed0"] == {"rollout/x": {"mean": 3.2, "first3": [1.0, 2.0, 3.0], "last3": [3.0, 4.0, 6.0], "n": 5}}
    assert figures["grpo_seed0"]["rollout/x"]["mean"] == 5.0
