"""``r3l``: LightningCLI for r3lightning (``r3l fit --config ...``, ``r3l validate --config ...``)."""

from __future__ import annotations

import os
import sys

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningCLI

from callbacks.phase_report import PhaseReport
from r3lightning.data.datamodule import RolloutDataModule
from r3lightning.module import R3LightningModule

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "r3l"},
    },
    "callbacks": [PhaseReport()],
    "accelerator": "auto",
    "devices": 1,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
}


class R3LightningCLI(LightningCLI):
    """LightningCLI with r3lightning's module and datamodule and sensible RL defaults.

    The phase report (validation success after warm-start and after RL) is always on, and a rich
    progress bar unless ``trainer.enable_progress_bar`` is false; further callbacks come from
    ``trainer.callbacks`` in the config.
    """

    def _instantiate_trainer(self, config: dict, callbacks: list):
        if config.get("enable_progress_bar", True) is not False:
            callbacks = [*callbacks, RichProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def __init__(self, args=None, run: bool = True) -> None:
        super().__init__(
            R3LightningModule,
            RolloutDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )


def main(args: list[str] | None = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    R3LightningCLI(args=args if args is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
