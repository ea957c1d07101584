"""What a checkpoint must hold and prove before it is loaded, and which config types it may contain."""

from __future__ import annotations

import dataclasses
import os
import pickle
import zipfile
import zlib
from typing import Any

import torch

from r3lightning.models import tokenizer_fingerprint


def allow_in_checkpoints(*configs: Any) -> None:
    """Allow the config dataclasses in ``configs`` (and those nested in them) in ``torch.load(weights_only=True)``.

    Checkpoints store the module's init arguments as hyper-parameters; Lightning resumes
    (``fit(ckpt_path=...)``) with torch's default ``weights_only=True`` loader, which refuses any class
    it was not told about, so without this a module built in Python could not resume from its own
    checkpoint. Only these plain config dataclasses are allowed, nothing executable.
    """
    found: set[type] = set()
    stack = list(configs)
    while stack:
        value = stack.pop()
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if type(value) not in found:
                found.add(type(value))
                stack.extend(getattr(value, f.name) for f in dataclasses.fields(value))
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
    if found:
        torch.serialization.add_safe_globals(sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}"))


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
    # The module registers its config dataclasses (the hyper-parameters) with the safe loader on import.
    import r3lightning.module  # noqa: F401

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


def r3lightning_section(phase: str, weight_version: int, skipped_steps: int, tokenizer, model_config, in_memory_tokenizer: bool) -> dict[str, Any]:
    """The ``checkpoint["r3lightning"]`` section: what resuming needs beyond the weights."""
    return {
        "phase": phase,
        "weight_version": weight_version,
        "skipped_steps": skipped_steps,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "tokenizer_json": tokenizer.backend_tokenizer.to_str() if in_memory_tokenizer else None,
        "model_config": repr(model_config),
    }


def check_loadable(checkpoint: dict[str, Any], own: dict[str, torch.Tensor], tokenizer, sft_warmup_steps: int) -> dict[str, Any]:
    """Refuse a checkpoint that does not fit this run (tokenizer, parameter shapes, missing weights),
    and fill in a missing KL reference where this run's own is the right one. Returns the checkpoint's
    ``r3lightning`` section. ``own``: the module's state dict."""
    saved = checkpoint.get("r3lightning")
    if saved is None:
        raise ValueError("checkpoint was not written by r3lightning (no 'r3lightning' section)")
    if saved["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise ValueError(
            "checkpoint: its tokenizer differs from this run's (changed model or task suite?). "
            "Resume with the configuration the checkpoint was trained with."
        )
    mismatched = [k for k, v in checkpoint["state_dict"].items() if k in own and tuple(own[k].shape) != tuple(v.shape)]
    missing = [k for k in own if k not in checkpoint["state_dict"] and not k.startswith("val_metrics")]
    no_reference = [k for k in missing if k.startswith("reference.")]
    if no_reference:
        if 0 < sft_warmup_steps < checkpoint.get("global_step", 0):
            raise ValueError(
                f"checkpoint: it has no reference model (trained with kl_coef 0) and is past the warm-start "
                f"(step {checkpoint['global_step']} > sft_warmup_steps {sft_warmup_steps}), so the warm-started policy "
                "the KL should anchor to is not in it. Resume with kl_coef: 0, or from a checkpoint saved "
                f"by step {sft_warmup_steps}."
            )
        # Before the first RL step the reference is either the initial model (rebuilt identically by
        # configure_model) or about to be anchored to the warm-started policy: this run's own will do.
        for key in no_reference:
            checkpoint["state_dict"][key] = own[key]
        missing = [k for k in missing if not k.startswith("reference.")]
    if mismatched or missing:
        example = (mismatched or missing)[0]
        raise ValueError(
            f"checkpoint: model does not match this configuration ({len(mismatched)} parameters with other "
            f"shapes, {len(missing)} missing; e.g. {example!r}). Saved model config: {saved['model_config']}"
        )
    return saved
