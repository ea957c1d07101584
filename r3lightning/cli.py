"""``r3l``: LightningCLI for r3lightning (``r3l fit --config ...``, ``r3l validate --config ...``),
``r3l export --ckpt_path X.ckpt --out DIR`` (``r3lightning.export``), and ReflectRL's data tools
``r3l gnt-pool`` and ``r3l reflect-sft`` (``r3lightning.data.reflectrl_tools``)."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import traceback
import warnings
from argparse import ArgumentError

import lightning as L
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
if "suggest_integrations" in inspect.signature(L.Trainer.__init__).parameters:
    # Lightning's switch for its "💡 Tip: try litlogger / litmodels" lines, once released (see quiet_lightning).
    TRAINER_DEFAULTS["suggest_integrations"] = False

QUIET_WARNINGS = (
    # torch deprecated LeafSpec (2.13 warns); lightning's _pytree still builds one on every logged metric.
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree"),
    # With model.algorithm.kl_coef > 0 the module holds a frozen reference policy, in eval mode by design.
    (UserWarning, r"Found \d+ module\(s\) in eval mode at the start of training", r"lightning\.pytorch\.loops\.fit_loop"),
)
"""(category, message regex, module regex) of the warnings ``r3l`` hides: dependency deprecation notices
and Lightning notices about r3lightning's own design, nothing a user of r3l can act on. Each is filtered
by its message and the module that raises it, nothing broader."""

LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
"""The loggers behind Lightning's ``rank_zero_info`` console lines."""


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def quiet_lightning() -> None:
    """Hide what ``r3l`` users cannot act on: the warnings of ``QUIET_WARNINGS`` (dependency
    deprecation notices, Lightning's notice about the frozen reference) and Lightning's advertising tips ("💡 Tip: ... litlogger / litmodels").

    Lightning prints the tips through ``rank_zero_info`` whenever no ``LitLogger`` is configured and
    whenever it adds its default ``ModelCheckpoint``. Lightning's next release adds
    ``Trainer(suggest_integrations=False)`` to turn them off (Lightning-AI/pytorch-lightning#21632; set
    in ``TRAINER_DEFAULTS`` when the installed Trainer has it). For the versions without it, a logging
    filter on the loggers of ``rank_zero_info`` drops exactly the lines that start with "💡 Tip:";
    every other info line (devices, seed, stop reason, checkpoint restores) stays."""
    for category, message, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name in LIGHTNING_INFO_LOGGERS:
        logger = logging.getLogger(name)
        if _not_a_tip not in logger.filters:
            logger.addFilter(_not_a_tip)


class StepProgressBar(RichProgressBar):
    """A rich progress bar of optimizer steps: ``global_step / max_steps`` (the task stream is endless,
    so Lightning's epoch counter says "Epoch 0/-2"), the phase (SFT warm-start or RL) as its
    description, and the figures worth watching (``PROGRESS_FIGURES``) instead of every ``prog_bar``
    metric."""

    PROGRESS_FIGURES = (
        ("train/loss", "loss", "{:.3f}"),
        ("reward/mean", "reward", "{:.3f}"),
        ("reward/success_rate", "success", "{:.0%}"),
        ("rollout/response_len", "len", "{:.1f}"),
        ("time/rollout_s", "rollout", "{:.1f}s"),
        ("val/success_rate_greedy", "val greedy", "{:.1%}"),
    )
    """(tag, label, format) shown after the bar, when the tag has been logged."""

    @property
    def total_train_batches(self):
        max_steps = self.trainer.max_steps
        return max_steps if max_steps is not None and max_steps > 0 else super().total_train_batches

    def _description(self, pl_module=None) -> str:
        phase = getattr(pl_module if pl_module is not None else self.trainer.lightning_module, "phase", None)
        text = {"sft": "SFT warm-start", "rl": "RL"}.get(phase, "Training")
        return f"{text:{len(self.validation_description)}}"

    def _get_train_description(self, current_epoch: int) -> str:
        return self._description()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        if self.progress is not None and self.is_enabled and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=self._description(pl_module))
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer, pl_module) -> dict[str, str]:
        metrics = trainer.callback_metrics
        return {label: fmt.format(float(metrics[tag])) for tag, label, fmt in self.PROGRESS_FIGURES if tag in metrics}


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

    The phase report (validation success after warm-start and after RL, validation files, progress
    plot) is always on, and a rich progress bar of steps (``StepProgressBar``) unless
    ``trainer.enable_progress_bar`` is false; further callbacks come from
    ``trainer.callbacks`` in the config. The training-dynamics monitor, the health watchdog and the
    rollout sample logger (docs/monitoring.md) are added with their defaults unless the config
    names its own instance of that class.
    """

    def _instantiate_trainer(self, config: dict, callbacks: list):
        if config.get("enable_progress_bar", True) is not False:
            callbacks = [*callbacks, StepProgressBar()]
        configured = config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        defaults = [class_from_path(path) for path in (PHASE_REPORT, *MONITORING_CALLBACKS)]
        callbacks = [*callbacks, *(cls() for cls in defaults if not any(isinstance(c, cls) for c in configured))]
        return super()._instantiate_trainer(config, callbacks)

    def parse_arguments(self, parser, args) -> None:
        """Parse; a bad key, value or file ends with ``r3l: error: <message>`` (which names it) and exit
        status 2, not with jsonargparse's whole usage text above the message."""
        argv = args if args is not None else sys.argv[1:]
        check_config_files(argv)
        parsers = [parser, *getattr(self, "_subcommand_parsers", {}).values()]
        exits = [p.exit_on_error for p in parsers]
        for p in parsers:
            p.exit_on_error = False  # raise ArgumentError instead of printing the usage and exiting
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            commands = getattr(self, "_subcommand_parsers", {})
            command = next((a for a in argv if a in commands), None) if isinstance(argv, (list, tuple)) else None
            hint = f"r3l {command} --help lists the accepted keys" if command else "r3l --help lists the commands"
            print(f"r3l: error: {err}\n  ({hint})", file=sys.stderr)
            raise SystemExit(2) from None
        finally:
            for p, exit_on_error in zip(parsers, exits):
                p.exit_on_error = exit_on_error

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
    quiet_lightning()
    # Arguments from the command line go to LightningCLI as None (it reads sys.argv itself): given
    # explicitly as well, it warns that args and command-line arguments were both given.
    from_command_line = args is None
    args = list(args if args is not None else sys.argv[1:])
    if args[:1] == ["export"]:
        from r3lightning.export import main as export_main

        export_main(args[1:])
        return
    if args[:1] in (["gnt-pool"], ["reflect-sft"]):
        from r3lightning.data.reflectrl_tools import main as reflectrl_main
        from r3lightning.export import load_policy

        reflectrl_main(args[0], args[1:], load_policy)
        return
    try:
        R3LightningCLI(args=None if from_command_line else args)
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
