"""``r3l``: LightningCLI for r3lightning (``r3l fit --config ...``, ``r3l validate --config ...``),
``r3l export --ckpt_path X.ckpt --out DIR`` (``r3lightning.cli.export``), and ReflectRL's data tools
``r3l gnt-pool`` and ``r3l reflect-sft`` (``r3lightning.cli.reflectrl``). The ``r3l`` script enters
through ``r3lightning.cli.console``, which answers the help and refusals that need no Lightning.

The CLI is the top layer: it imports the callbacks it adds by default like any other module."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import pickle
import signal
import sys
import traceback
import warnings
from argparse import ArgumentError
from typing import Any, Literal, Optional

import lightning as L
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.plugins.io import CheckpointIO

from r3lightning.callbacks import (
    ComponentHealth,
    HealthWatchdog,
    PhaseReport,
    RolloutSampleLogger,
    StepCheckpoint,
    TrainingDynamicsMonitor,
    VLLMWeightSync,
)
from r3lightning.checkpointing.io import AtomicCheckpointIO, last_checkpoint_places, newest_last_checkpoint
from r3lightning.checkpointing.read import read_checkpoint
from r3lightning.checkpointing.resume import check_resume, plain
from r3lightning.cli.config_yaml import DuplicateKeyError, check_no_duplicate_keys, use_strict_yaml
from r3lightning.cli.export import main as export_main
from r3lightning.cli.wandb_check import check_wandb_loggers
from r3lightning.cli.moved_names import check_moved_class_paths
from r3lightning.cli.progress import StepProgressBar
from r3lightning.cli.reflectrl import main as reflectrl_main
from r3lightning.data.datamodule import RolloutDataModule
from r3lightning.engines.config import replaced_key_note
from r3lightning.training.phases import replaced_key_note as replaced_phase_key_note
from r3lightning.module import R3LightningModule
from r3lightning.training.checkpoint_state import check_checkpoint_state

MONITORING_CALLBACKS = (TrainingDynamicsMonitor, HealthWatchdog, RolloutSampleLogger)
"""Added with their defaults unless the config names an instance of the class (docs/monitoring.md)."""

INERT_TRAINER_FLAGS = {
    "gradient_clip_val": (0, "set model.optim.grad_clip (the largest global gradient norm; 0 disables clipping)"),
    "accumulate_grad_batches": (1, "a step's whole batch is one optimizer step already, accumulated over "
                                   "model.optim.micro_batch_size micro-batches; data.tasks_per_step and data.group_size size the batch"),
}
"""Trainer flags of automatic optimization: (the value that does nothing, what to set instead)."""

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


def class_from_path(path: str) -> type:
    """The class a config's dotted ``module.Class`` path names (a user's ``class_path``)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def check_config_files(args) -> None:
    """Exit with a clear message naming the file, line and column when a ``--config`` file is not valid YAML
    (jsonargparse would report the problem inside "<unicode string>", without the file's name), or naming
    the file, the key and both lines when it gives a key twice (YAML would keep the last silently)."""
    if not isinstance(args, (list, tuple)):
        return
    paths = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            paths.append(args[i + 1])
        elif isinstance(arg, str) and arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
        elif isinstance(arg, str) and arg.endswith((".yaml", ".yml")) and os.path.isfile(arg.split("=", 1)[-1]):
            paths.append(arg.split("=", 1)[-1])  # a section's own file: --data data.yaml
    for path in paths:
        if not os.path.isfile(path):
            continue  # jsonargparse reports missing files itself
        try:
            with open(path) as handle:
                text = handle.read()
            yaml.safe_load(text)
            check_no_duplicate_keys(text, f"config file {path!r}")
        except DuplicateKeyError as err:
            print(f"r3l: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err)
            print(f"r3l: error: config file {path!r} is not valid YAML{where}: {problem}", file=sys.stderr)
            raise SystemExit(2) from None


EVALUATING = ("validate", "test", "predict")
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc")
"""``ckpt_path`` values Lightning resolves itself (no file to check here)."""


def unhealthy_stop(cli: LightningCLI) -> Optional[str]:
    """Why a finished ``r3l fit`` stopped unhealthy (``model.max_bad_steps`` consecutive non-finite
    steps), or None. Names the health watchdog's checkpoint of the last good weights when it saved one."""
    module = getattr(cli, "model", None)
    trainer = getattr(cli, "trainer", None)
    if getattr(cli, "subcommand", None) != "fit" or module is None or trainer is None:
        return None
    bad, limit = int(getattr(module, "consecutive_bad_steps", 0)), int(getattr(module, "max_bad_steps", 0) or 0)
    if limit <= 0 or bad < limit:
        return None
    saved = next((c.stop_checkpoint for c in trainer.callbacks if isinstance(c, HealthWatchdog) and c.stop_checkpoint), None)
    where = f"; the last good weights are in {saved}" if saved else ""
    return (
        f"training stopped unhealthy at global step {trainer.global_step}: {bad} consecutive steps with non-finite "
        f"loss or gradients (model.max_bad_steps={limit}; see train/skipped_steps){where}"
    )


def added_callbacks(trainer_config: dict, engine_backend: str) -> list:
    """The callbacks ``r3l`` adds to the ``trainer:`` section's own (``trainer_config["callbacks"]``,
    instantiated): the step progress bar unless ``enable_progress_bar`` is false; the phase report and
    ``MONITORING_CALLBACKS`` unless the config names an instance of that class; ``StepCheckpoint``
    (``last.ckpt`` every N steps, at the end of fit and on SIGTERM/SIGINT: docs/reliability.md) unless
    it names a ``ModelCheckpoint`` or sets ``enable_checkpointing: false``; ``VLLMWeightSync`` when
    ``engine_backend`` is ``vllm`` unless it names one (without it vLLM samples from the initial
    weights for the whole run)."""
    configured = trainer_config.get("callbacks") or []
    configured = configured if isinstance(configured, list) else [configured]
    added = [StepProgressBar()] if trainer_config.get("enable_progress_bar", True) is not False else []
    defaults = [PhaseReport, *MONITORING_CALLBACKS]
    if engine_backend == "vllm":
        defaults.append(VLLMWeightSync)
    added += [cls() for cls in defaults if not any(isinstance(c, cls) for c in configured)]
    if trainer_config.get("enable_checkpointing", True) is not False and not any(isinstance(c, ModelCheckpoint) for c in configured):
        added.append(StepCheckpoint())
    return added


class R3LightningCLI(LightningCLI):
    """LightningCLI with r3lightning's module and datamodule and sensible RL defaults.

    The phase report (validation success after warm-start and after RL, validation files, progress
    plot) is always on, and a rich progress bar of steps (``StepProgressBar``) unless
    ``trainer.enable_progress_bar`` is false; further callbacks come from
    ``trainer.callbacks`` in the config. The training-dynamics monitor, the health watchdog and the
    rollout sample logger (docs/monitoring.md), and with ``model.engine.backend: vllm`` the weight
    sync, are added with their defaults unless the config names its own instance of that class
    (``added_callbacks``).
    """

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate`` (LightningCLI's ``test`` and ``predict`` have no meaning here:
        ``r3lightning.cli.console.REFUSED_COMMANDS`` says what to use instead)."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def add_core_arguments_to_parser(self, parser) -> None:
        """LightningCLI's sections with r3lightning's own (``model``, ``data``) before the Trainer's
        flags, so that ``r3l fit --help`` opens with them."""
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data)
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})

    def before_instantiate_classes(self) -> None:
        """Refuse the Trainer flags that manual optimization ignores (``INERT_TRAINER_FLAGS``), naming the
        key that does the job here. An unset ``data.seed`` takes the run's ``seed_everything`` (as
        LightningCLI resolved it), so the sampling follows the seed Lightning users vary."""
        subcommand = self.config.get("subcommand")
        trainer = self.config[subcommand].get("trainer") if subcommand else None
        resolve_sampling_seed(self.config[subcommand] if subcommand else self.config)
        if trainer is None:
            return
        for flag, (inert, instead) in INERT_TRAINER_FLAGS.items():
            value = trainer.get(flag)
            if value is not None and value != inert:
                raise ValueError(f"trainer.{flag} ({value}) does nothing in r3lightning (the module steps its optimizer itself); {instead}")

    def _instantiate_trainer(self, config: dict, callbacks: list):
        backend = getattr(getattr(self.model, "engine_config", None), "backend", "hf")
        callbacks = [*callbacks, *added_callbacks(config, backend)]
        plugins = config.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            # Checkpoint files are written to a temporary file and renamed: never half-written.
            config = {**config, "plugins": [*plugins, AtomicCheckpointIO()]}
        trainer = super()._instantiate_trainer(config, callbacks)
        check_wandb_loggers(trainer.loggers)
        for logger in trainer.loggers:
            # TensorBoard's hp_metric is -1 for the whole run: nothing here reports one.
            if hasattr(logger, "_default_hp_metric"):
                logger._default_hp_metric = False
        return trainer

    def _parse_ckpt_path(self) -> None:
        """Replaces LightningCLI's (which would re-apply the checkpoint's saved settings silently):
        resolve ``--ckpt_path last`` (``resolve_last_ckpt_path``), then check the file and compare it
        with the config (``_check_ckpt_path``), so ``last`` behaves exactly as the file's path would."""
        resolve_last_ckpt_path(self.config)
        self._check_ckpt_path()

    def after_fit(self) -> None:
        """Exit with status 128 + the signal's number when a signal stopped training (``StepCheckpoint``
        has saved ``last.ckpt`` and printed how to resume)."""
        for callback in self.trainer.callbacks:
            name = callback.stopped_by_signal if isinstance(callback, StepCheckpoint) else None
            if name:
                raise SystemExit(128 + int(getattr(signal.Signals, name, signal.SIGTERM)))

    def _run_subcommand(self, subcommand: str) -> None:
        """A second SIGINT stops training through Lightning's ``KeyboardInterrupt`` handling, which exits
        with status 1: exit 130 (128 + the signal) instead, as the first SIGINT does."""
        try:
            super()._run_subcommand(subcommand)
        except SystemExit as stop:
            name = next((c.interrupted_by for c in self.trainer.callbacks if isinstance(c, StepCheckpoint) and c.interrupted_by), None)
            if name and stop.code == 1:
                raise SystemExit(128 + int(signal.Signals[name])) from None
            raise

    def parse_arguments(self, parser, args) -> None:
        """Parse; a bad key, value or file ends with ``r3l: error: <message>`` (which names it) and exit
        status 2, not with jsonargparse's whole usage text above the message."""
        argv = args if args is not None else sys.argv[1:]
        check_config_files(argv)
        check_moved_class_paths(argv)
        use_strict_yaml()  # YAML read by jsonargparse (config files, values) refuses repeated keys too
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
            notes = replaced_key_note(str(err)) + replaced_phase_key_note(str(err))
            print(f"r3l: error: {err}{notes}\n  ({hint})", file=sys.stderr)
            raise SystemExit(2) from None
        finally:
            for p, exit_on_error in zip(parsers, exits):
                p.exit_on_error = exit_on_error

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ComponentHealth, "health")
        parser.add_argument(
            "--resume_with",
            type=Optional[Literal["checkpoint", "config"]],
            default=None,
            help=(
                "With --ckpt_path, where the config and the checkpoint differ on a key that defines the run "
                "(model shape or source, the algorithm's method fields, dtype, LoRA, chat template, warm-start): "
                "unset refuses to start and names each key; 'checkpoint' takes the checkpoint's values for every "
                "model key; 'config' keeps the config's (the shape must still match). Tuning keys (learning "
                "rate, micro-batching, engine) always take the config's values unless 'checkpoint' is given."
            ),
        )

    def _check_ckpt_path(self) -> None:
        """Called by ``_parse_ckpt_path`` in place of LightningCLI's, which loads ``--ckpt_path`` and silently
        re-applies the checkpoint's saved ``model:`` init arguments over the parsed config. Here the file is checked where it enters
        (``read_checkpoint``: one error naming it and what is wrong), then compared with the config
        (``check_resume``): the checkpoint's values are applied only with ``--resume_with checkpoint``.
        ``r3l validate``/``test``/``predict`` without ``--ckpt_path`` are refused for a tiny model built at
        random (nothing trained to evaluate); a pretrained ``model.model.name_or_path`` (or ``gguf_file``) may be evaluated as is."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        section = self.config[subcommand]
        ckpt_path = section.get("ckpt_path")
        resume_with = section.get("resume_with")
        if not ckpt_path:
            if subcommand in EVALUATING and not (section.get("model.model.name_or_path") or section.get("model.model.gguf_file")):
                raise ValueError(
                    f"r3l {subcommand}: no --ckpt_path, and the model is a tiny model built at random "
                    "(model.model.name_or_path and gguf_file are empty), so there is nothing trained to evaluate; give "
                    "--ckpt_path CHECKPOINT (a .ckpt written by r3l fit), or a pretrained model as model.model.name_or_path"
                )
            if resume_with:
                raise ValueError("--resume_with is given without --ckpt_path: there is no checkpoint to resume from")
            return
        if ckpt_path in LIGHTNING_CKPT_NAMES or str(ckpt_path).startswith("registry") and not os.path.exists(ckpt_path):
            return  # resolved by Lightning from the run's own checkpoint callback
        checkpoint = read_checkpoint(ckpt_path)
        check_checkpoint_state(checkpoint, ckpt_path)
        hparams = dict(checkpoint["hyper_parameters"])
        hparams.pop("_instantiator", None)
        hparams.pop("_class_path", None)
        del checkpoint  # memory-mapped; Lightning loads it again when it restores
        apply, note = check_resume(ckpt_path, hparams, section.get("model"), resume_with)
        if note:
            rank_zero_print(note)
        if apply:
            self.config = self.parser.parse_object({subcommand: {"model": plain(hparams)}}, self.config)

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


@rank_zero_only
def rank_zero_print(message: str) -> None:
    print(message, flush=True)


EXPECTED_ERRORS = (ValueError, OSError, ImportError, EOFError, pickle.UnpicklingError)
"""The error families of bad input (a file, a setting, a source that cannot be used here: ``ValueError``
and its ``JSONDecodeError``/``UnicodeDecodeError``, ``OSError`` and its ``FileNotFoundError``/
``ConnectionError``/``PermissionError``, an optional package that is not installed, an unreadable pickle):
``r3l`` reports them in one line, exit status 1. Anything else is a bug and keeps its traceback."""
UNHEALTHY_EXIT = 3
"""Exit status of an ``r3l fit`` the health checks stopped (``model.max_bad_steps`` non-finite steps in a row)."""


def one_line(err: BaseException) -> str:
    """The error's message on one line (libraries' messages often span several)."""
    return " ".join(str(err).split()) or type(err).__name__


def _checkpoint_dirs_of(trainer: Any) -> tuple[list[str], Optional[tuple[str, str]], str]:
    """From a parsed ``trainer:`` section: the fixed ``dirpath`` of its ``ModelCheckpoint`` callbacks,
    the first logger's ``(save_dir, name)`` (None without a logger) and ``default_root_dir``."""
    get = lambda ns, key, default=None: (ns.get(key, default) if hasattr(ns, "get") else default)  # noqa: E731
    root = str(get(trainer, "default_root_dir") or os.getcwd())
    dirs = []
    callbacks = get(trainer, "callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        class_path, init_args = get(callback, "class_path"), get(callback, "init_args")
        dirpath = get(init_args, "dirpath") if init_args is not None else getattr(callback, "dirpath", None)
        try:
            is_checkpoint = isinstance(callback, ModelCheckpoint) or (
                class_path is not None and issubclass(class_from_path(class_path), ModelCheckpoint)
            )
        except (ImportError, AttributeError, TypeError):
            is_checkpoint = False
        if is_checkpoint and dirpath:
            dirs.append(str(dirpath))
    logger = get(trainer, "logger", True)
    logger = logger[0] if isinstance(logger, list) and logger else logger
    if logger is False or logger is None or logger == []:
        return dirs, None, root
    if logger is True:
        return dirs, (root, "lightning_logs"), root
    init_args = get(logger, "init_args")
    save_dir = get(init_args, "save_dir") if init_args is not None else getattr(logger, "save_dir", None)
    name = get(init_args, "name") if init_args is not None else getattr(logger, "name", None)
    if str(get(logger, "class_path", "")).endswith("WandbLogger"):
        # W&B files the run under its project, in save_dir (or dir; default the working directory), by run id.
        project = get(init_args, "project") or os.environ.get("WANDB_PROJECT") or "lightning_logs"
        return dirs, (str(save_dir or get(init_args, "dir") or "."), str(project)), root
    return dirs, (str(save_dir or root), str(name if name is not None else "lightning_logs")), root
def resolve_sampling_seed(section: Any) -> None:
    """An unset ``data.seed`` in a parsed ``fit``/``validate`` section becomes the run's
    ``seed_everything`` when that is a number (LightningCLI has replaced ``true`` by the seed it drew),
    so ``--seed_everything N`` varies the rollouts; a given ``data.seed`` is kept."""
    seed = section.get("seed_everything")
    if section.get("data.seed") is None and isinstance(seed, int) and not isinstance(seed, bool):
        section["data.seed"] = seed




def resolve_last_ckpt_path(config: Any) -> None:
    """``ckpt_path: last`` in a parsed ``r3l`` config becomes the newest ``last.ckpt`` of the run
    (``r3lightning.checkpointing.io.last_checkpoint_places``: the fixed ``dirpath`` of a configured
    ``ModelCheckpoint``, and ``<save_dir>/<name>/*/checkpoints/`` of the logger, i.e. every version of
    the run; ``<default_root_dir>/checkpoints`` without a logger). Nothing found: a ``ValueError``
    naming where it looked, before anything is built. (Lightning's own ``"last"`` looks only in the new
    run's empty version folder, warns, and trains from step 0.)"""
    subcommand = config.get("subcommand") if hasattr(config, "get") else None
    section = config.get(subcommand) if subcommand else None
    if section is None or section.get("ckpt_path") != "last":
        return
    dirs, logger_dir, root = _checkpoint_dirs_of(section.get("trainer"))
    path = newest_last_checkpoint(last_checkpoint_places(dirs, logger_dir, None if logger_dir else root))
    print(f"[r3lightning] --ckpt_path last: {path}", flush=True)
    section["ckpt_path"] = path


def importable_working_directory() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does: a config may name
    ``my_rewards:score`` or ``my_package.MySuite`` from the directory ``r3l`` runs in (the ``r3l``
    script's own ``sys.path[0]`` is the directory of the script)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``r3l``. Bad input (``EXPECTED_ERRORS``: a missing or damaged checkpoint or model
    directory, an empty or malformed dataset, a config that contradicts its checkpoint, a bad setting)
    ends with its one-line message and where it was raised, exit status 1; set ``R3L_TRACEBACK=1`` for the
    full traceback. A configuration that does not parse exits 2 (``parse_arguments``). A fit the health
    checks stopped (non-finite steps) exits 3 (``UNHEALTHY_EXIT``) with the reason."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    importable_working_directory()
    quiet_lightning()
    # Arguments from the command line go to LightningCLI as None (it reads sys.argv itself): given
    # explicitly as well, it warns that args and command-line arguments were both given.
    from_command_line = args is None
    args = list(args if args is not None else sys.argv[1:])
    if args[:1] == ["export"]:
        export_main(args[1:])
        return
    if args[:1] in (["gnt-pool"], ["reflect-sft"]):
        reflectrl_main(args[0], args[1:])
        return
    try:
        cli = R3LightningCLI(args=None if from_command_line else args)
    except EXPECTED_ERRORS as err:
        if os.environ.get("R3L_TRACEBACK", "0") not in ("", "0"):
            raise
        frame = traceback.extract_tb(err.__traceback__)[-1]
        print(
            f"r3l: error: {one_line(err)}\n  ({type(err).__name__} raised at {frame.filename}:{frame.lineno}; "
            "set R3L_TRACEBACK=1 for the full traceback)",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    reason = unhealthy_stop(cli)
    if reason:
        print(f"r3l: error: {reason}", file=sys.stderr)
        raise SystemExit(UNHEALTHY_EXIT)


if __name__ == "__main__":
    main()
