"""Checkpoint files that are never half-written, and where ``--ckpt_path last`` looks.

``AtomicCheckpointIO`` (installed by ``r3l`` by default) writes every checkpoint file into a temporary
file in the same directory, flushes it to disk and renames it over the target with ``os.replace``:
a reader (or a resume after a crash, a full disk or a kill during the write) sees either the old file
or the new one, never a partial one. Lightning's own ``TorchCheckpointIO`` serializes into memory and
moves a temporary file from the system's temp directory, which is a copy (not atomic) when that
directory is on another filesystem.

``last_checkpoint_places`` / ``newest_last_checkpoint`` are the rule behind ``r3l fit --ckpt_path last`` (docs/reliability.md).
"""

from __future__ import annotations

import glob
import os
import re
import uuid
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

LAST_CHECKPOINT = "last.ckpt"


def _temporary_name(path: str) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


_TEMPORARY = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}\.tmp$")
"""``_temporary_name``'s pattern: the process id of the writer, then a random tag."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, but another user's
        return True
    return True


def remove_stale_partials(places: list[str]) -> list[str]:
    """Remove the temporary files of saves that never finished (a SIGKILL or a power cut during
    ``atomic_write``) from the directories ``places`` (directories or glob patterns of directories),
    skipping those of a process that is still running; returns the paths removed."""
    removed = []
    for place in places:
        for directory in glob.glob(place):
            for name in os.listdir(directory) if os.path.isdir(directory) else []:
                match = _TEMPORARY.match(name)
                if match is None or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
                    continue
                path = os.path.join(directory, name)
                try:
                    os.remove(path)
                except OSError:
                    continue
                removed.append(path)
    return removed


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Call ``write(handle)`` on a temporary file next to ``path``, flush it to disk and rename it over
    ``path`` (``os.replace``). If anything fails, the temporary file is removed and ``path`` is left as
    it was."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = _temporary_name(path)
    try:
        with open(temporary, "xb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        _remove_quietly(temporary)
        raise
    _replace(temporary, path)
    _fsync_directory(os.path.dirname(path))


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``, atomically (``atomic_write``)."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


def atomic_link(source: str, path: str) -> None:
    """Make ``path`` the same file as ``source``, atomically: a hard link (no copy) renamed over
    ``path``; a copy where the filesystem has no hard links."""
    temporary = _temporary_name(path)
    try:
        os.link(source, temporary)
    except OSError:
        with open(source, "rb") as src:
            atomic_write(path, lambda handle: _copy(src, handle))
        return
    _replace(temporary, path)


def _replace(temporary: str, path: str) -> None:
    """Rename ``temporary`` over ``path``; on failure remove ``temporary`` (nothing partial is left)."""
    try:
        os.replace(temporary, path)
    except BaseException:
        _remove_quietly(temporary)
        raise


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _copy(src, dst, chunk: int = 1 << 24) -> None:
    while block := src.read(chunk):
        dst.write(block)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local files are written atomically (``atomic_torch_save``); remote
    paths (``s3://``...) go through Lightning's own writer."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        atomic_torch_save(checkpoint, str(path))


def last_checkpoint_places(
    checkpoint_dirs: list[str], logger_dir: Optional[tuple[str, str]], default_root_dir: Optional[str]
) -> list[str]:
    """Where ``--ckpt_path last`` looks: each checkpoint directory named in ``checkpoint_dirs`` (a
    checkpoint callback's fixed ``dirpath``); with a logger (``logger_dir`` = its ``(save_dir, name)``)
    every version of the run, ``<save_dir>/<name>/*/checkpoints`` (each ``r3l fit`` writes a
    new ``version_N``); without one ``<default_root_dir>/checkpoints``."""
    places = [glob.escape(str(d)) for d in checkpoint_dirs]
    if logger_dir is not None:
        places.append(os.path.join(glob.escape(str(logger_dir[0])), glob.escape(str(logger_dir[1])), "*", "checkpoints"))
    elif default_root_dir is not None:
        places.append(os.path.join(str(default_root_dir), "checkpoints"))
    return list(dict.fromkeys(places))


def find_last_checkpoints(places: list[str]) -> list[str]:
    """The ``last.ckpt`` files (and Lightning's ``last-v<N>.ckpt``) in ``places`` (directories or glob
    patterns of directories)."""
    found: set[str] = set()
    for place in places:
        for directory in glob.glob(place):
            for name in ("last.ckpt", "last-v*.ckpt"):
                found |= {os.path.normpath(p) for p in glob.glob(os.path.join(glob.escape(directory), name))}
    return sorted(found)


def newest_last_checkpoint(places: list[str], option: str = "--ckpt_path") -> str:
    """The newest (by modification time) of ``find_last_checkpoints(places)``, or a ``ValueError``
    naming where it looked."""
    found = find_last_checkpoints(places)
    if not found:
        where = ", ".join(places) if places else "nowhere (no checkpoint directory and no logger)"
        raise ValueError(f"{option} last: no last.ckpt found (looked in {where}); give the checkpoint's path instead")
    return max(found, key=os.path.getmtime)


def trainer_last_checkpoint_places(trainer: L.Trainer, checkpoint_dirs: list[str]) -> list[str]:
    """``last_checkpoint_places`` of a built trainer."""
    logger = trainer.loggers[0] if trainer.loggers else None
    save_dir, name = getattr(logger, "save_dir", None), getattr(logger, "name", None)
    logger_dir = (save_dir, name) if save_dir and name else None
    return last_checkpoint_places(checkpoint_dirs, logger_dir, None if trainer.loggers else trainer.default_root_dir)
