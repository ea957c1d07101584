"""The run's own folder, where reports and validation files go (``log_dir_of``)."""

from __future__ import annotations

import os

import lightning as L


def log_dir_of(trainer: L.Trainer) -> str:
    """The run's own folder: the logger's ``log_dir`` (TensorBoard's, CSV's version folder); for a logger
    without one (W&B) ``<save_dir>/<name>/<version>``, the folder Lightning puts the run's
    ``checkpoints/`` in (W&B: ``<save_dir>/<project>/<run id>``), so validation files and reports never
    land in the working directory where the next run would overwrite them; the trainer's root directory
    without a logger.

    Asks the logger itself: ``Trainer.log_dir`` is a collective (broadcast) under DDP and hangs when
    only rank 0 calls it, as the callbacks and the distillation's report do.
    """
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if log_dir:
            return log_dir
    for logger in trainer.loggers:
        save_dir, name, version = logger.save_dir, logger.name, logger.version
        if save_dir and name and version is not None:
            return os.path.join(save_dir, str(name), version if isinstance(version, str) else f"version_{version}")
    return trainer.default_root_dir
