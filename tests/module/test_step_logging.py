"""Per-step scalars reach the loggers as computed: a tag a step did not compute has a gap there (not the
last value again), ``train/phase_rl`` is the phase of the step itself, and TensorBoard's constant
``hp_metric`` is off under ``r3l``."""

import yaml
from lightning.pytorch.loggers import Logger
from harness import TINY_CLI_RUN, module_and_data, quiet_trainer

from r3lightning.cli.main import R3LightningCLI


class RecordingLogger(Logger):
    def __init__(self):
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.setdefault(step, {}).update(metrics)


def test_a_tag_not_computed_at_a_step_has_a_gap_and_phase_rl_is_the_steps_own():
    module, dm = module_and_data(sft_steps=2)
    logger = RecordingLogger()
    quiet_trainer(4, logger=logger, log_every_n_steps=1).fit(module, dm)
    rows = logger.rows
    assert sorted(k for k in rows if "train/phase_rl" in rows[k]) == [0, 1, 2, 3]
    assert [rows[s]["train/phase_rl"] for s in range(4)] == [0.0, 0.0, 1.0, 1.0]
    # the warm-start's SFT loss only on warm-start steps; RL figures only on RL steps
    assert "train/loss_sft" in rows[1] and "train/loss_sft" not in rows[2] and "train/loss_sft" not in rows[3]
    assert "reward/mean" not in rows[1] and "reward/mean" in rows[2]


def test_r3l_turns_tensorboards_hp_metric_off(tmp_path):
    run = {**TINY_CLI_RUN, "trainer": {**TINY_CLI_RUN["trainer"], "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path)}}}}
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(run))
    cli = R3LightningCLI(args=["--config", str(recipe)], run=False)
    assert cli.trainer.loggers and all(getattr(lg, "_default_hp_metric", False) is False for lg in cli.trainer.loggers)
