"""``r3l``: LightningCLI for r3lightning (``r3l fit --config ...``, ``r3l validate --config ...``), and
``r3l export --ckpt_path X.ckpt --out DIR`` (``r3lightning.export``)."""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import yaml
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningCLI

from r3lightning.data.datamodule import RolloutDataModule
from r3lightning.module import R3LightningModule

# The CLI names its default callbacks by class path: the package never imports r3lightning.callbacks
# (the layer above it), so the callbacks can depend on the module and not the other way round.
PHASE_REPORT = "r3lightning.callbacks.PhaseReport"
MONITORING_CALLBACKS = (
    "r3lightning.callbacks.TrainingDynamicsMonitor",
    "r3lightning.callbacks.HealthWatchdog",
    "r3lightning.callbacks.RolloutSampleLogger",
)

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "r3l"},
    },
    "accelerator": "auto",
    "devices": 1,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
}


def class_from_path(path: str) -> type:
    """The class a dotted ``module.Class`` path names."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def check_config_files(args) -> None:
    """Exit with a clear message naming the file, line and column when a ``--config`` file is not valid YAML
    (jsonargparse would report the problem inside "<unicode string>", without the file's name)."""
    if not isinstance(args, (list, tuple)):
        return
    paths = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            paths.append(args[i + 1])
        elif isinstance(arg, str) and arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    for path in paths:
        if not os.path.isfile(path):
            continue  # jsonargparse reports missing files itself
        try:
            with open(path) as handle:
                yaml.safe_load(handle)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err)
            print(f"r3l: error: config file {path!r} is not valid YAML{where}: {problem}", file=sys.stderr)
            raise SystemExit(2) from None


class R3LightningCLI(LightningCLI):
    """LightningCLI with r3lightning's module and datamodule and sensible RL defaults.

    The phase report (validation success after warm-start and after RL) is always on, and a rich
    progress bar unless ``trainer.enable_progress_bar`` is false; further callbacks come from
    ``trainer.callbacks`` in the config. The training-dynamics monitor, the health watchdog and the
    rollout sample logger (docs/monitoring.md) are added with their defaults unless the config
    names its own instance of that class.
    """

    def _instantiate_trainer(self, config: dict, callbacks: list):
        if config.get("enable_progress_bar", True) is not False:
            callbacks = [*callbacks, RichProgressBar()]
        configured = config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        defaults = [class_from_path(path) for path in (PHASE_REPORT, *MONITORING_CALLBACKS)]
        callbacks = [*callbacks, *(cls() for cls in defaults if not any(isinstance(c, cls) for c in configured))]
        return super()._instantiate_trainer(config, callbacks)

    def parse_arguments(self, parser, args) -> None:
        check_config_files(args if args is not None else sys.argv[1:])
        super().parse_arguments(parser, args)

    def __init__(self, args=None, run: bool = True) -> None:
        super().__init__(
            R3LightningModule,
            RolloutDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            save_config_kwargs={"overwrite": True},
            # The module owns its optimizer (manual optimization, phase-dependent learning rate).
            auto_configure_optimizers=False,
            args=args,
            run=run,
        )


def main(args: list[str] | None = None) -> None:
    """Entry point of ``r3l``. Bad input (``ValueError``/``OSError``: a missing model directory, an empty or
    malformed dataset, a bad setting) ends with its one-line message and where it was raised, exit status 1;
    set ``R3L_TRACEBACK=1`` for the full traceback."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = list(args if args is not None else sys.argv[1:])
    if args[:1] == ["export"]:
        from r3lightning.export import main as export_main

        export_main(args[1:])
        return
    try:
        R3LightningCLI(args=args)
    except (ValueError, OSError) as err:
        if os.environ.get("R3L_TRACEBACK", "0") not in ("", "0"):
            raise
        frame = traceback.extract_tb(err.__traceback__)[-1]
        print(
            f"r3l: error: {err}\n  ({type(err).__name__} raised at {frame.filename}:{frame.lineno}; "
            "set R3L_TRACEBACK=1 for the full traceback)",
            file=sys.stderr,
        )
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
