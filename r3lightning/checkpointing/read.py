"""A checkpoint file handed in by a user (``--ckpt_path``, ``r3l export``), checked where it enters."""

from __future__ import annotations

import os
import pickle
import zipfile
import zlib
from typing import Any

import torch

# The module registers its config dataclasses (the hyper-parameters) with the safe loader on import.
import r3lightning.module  # noqa: F401

CHECKPOINT_KEYS = ("state_dict", "hyper_parameters", "r3lightning")
"""What every r3lightning checkpoint holds: the module's tensors, its init arguments (hyper-parameters) and
the ``r3lightning`` section (``r3lightning_section``)."""


def read_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint file ``path`` handed in by a user (``--ckpt_path``, ``r3l export``), checked where it
    enters: loaded on CPU, memory-mapped, with torch's safe (``weights_only``) unpickler.

    Raises ValueError with one line naming the file and what is wrong: a directory (sharded), no such
    file, an empty file, not a zip archive (truncated, or another kind of file), a member that fails its
    CRC-32 (a flipped byte, a partly written file: every member is read once to check it, about
    0.4 s per GB), objects the safe loader refuses, or a PyTorch file without an r3lightning checkpoint's
    ``state_dict`` / ``hyper_parameters`` / ``r3lightning`` sections.
    """
    if os.path.isdir(path):
        raise ValueError(
            f"checkpoint {path!r} is a directory (a sharded FSDP checkpoint?); consolidate it into one "
            "file first (python -m lightning.pytorch.utilities.consolidate_checkpoint)"
        )
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r}: no such file")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"checkpoint {path!r} is empty (0 bytes: a save that was interrupted?)")
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"checkpoint {path!r} is not a PyTorch checkpoint: not a zip archive ({size} bytes; a truncated "
            "copy, or another kind of file)"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as err:
        raise ValueError(f"checkpoint {path!r} is damaged: its archive cannot be read ({err})") from err
    if damaged is not None:
        raise ValueError(
            f"checkpoint {path!r} is damaged: its member {damaged!r} fails its CRC-32 check (corrupted on disk "
            "or in transfer, or partly written)"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"checkpoint {path!r} holds objects the safe loader refuses: {err}") from err
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {path!r} is not a PyTorch checkpoint ({type(err).__name__}: {err})") from err
    if not isinstance(checkpoint, dict):
        raise ValueError(f"checkpoint {path!r} was not written by r3lightning: it holds a {type(checkpoint).__name__}, not a dict")
    missing = [key for key in CHECKPOINT_KEYS if key not in checkpoint]
    if missing:
        raise ValueError(
            f"checkpoint {path!r} was not written by r3lightning: no {', '.join(map(repr, missing))} section "
            f"(it has {', '.join(map(repr, list(checkpoint)[:8])) or 'nothing'})"
        )
    section = checkpoint["r3lightning"]
    if not isinstance(section, dict) or "tokenizer_fingerprint" not in section:
        raise ValueError(f"checkpoint {path!r}: its 'r3lightning' section has no tokenizer_fingerprint")
    if not isinstance(checkpoint["hyper_parameters"], dict) or "model" not in checkpoint["hyper_parameters"]:
        raise ValueError(f"checkpoint {path!r}: its hyper_parameters have no 'model' (ModelConfig)")
    return checkpoint
