"""Export a training checkpoint, or a live policy, as a Hugging Face model directory (the library of
``r3l export`` and of the ``HuggingFaceExport`` callback).

A Lightning checkpoint of :class:`~r3lightning.module.R3LightningModule` holds everything needed:

- ``hyper_parameters["model"]``: the :class:`~r3lightning.training.models.ModelConfig` the policy was built
  from (a tiny spec, or ``name_or_path``; LoRA rank and targets);
- ``r3lightning["tokenizer_json"]``: the in-memory tokenizer of a tiny model (None for hub/local
  models, whose tokenizer is loaded from ``name_or_path`` again) and its ``tokenizer_fingerprint``;
- ``state_dict``: ``policy.*`` (the policy, with its LoRA adapters if any) and, with a KL penalty,
  ``reference.*`` (the frozen reference, not exported).

The policy is rebuilt from the config, its weights are loaded, and the directory gets what
``AutoModelForCausalLM`` / ``AutoTokenizer`` / vLLM read: ``config.json``, ``model.safetensors``
(LoRA merged by default), ``generation_config.json`` (end-of-turn and padding ids) and the tokenizer
with its chat template. ``lora="adapter"`` writes the PEFT adapter instead, for a base model others
can load (``name_or_path``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Literal

import torch
from safetensors import SafetensorError

from r3lightning.checkpointing.read import read_checkpoint
from r3lightning.training.models import (
    ModelConfig,
    TinyModelSpec,
    apply_lora,
    build_tiny_model,
    load_pretrained,
    tokenizer_fingerprint,
    tokenizer_from_json,
)

LoraExport = Literal["merged", "adapter"]


def load_checkpoint(ckpt_path: str) -> dict[str, Any]:
    """The checkpoint at ``ckpt_path``, loaded on CPU with torch's safe (``weights_only``) unpickler.

    Memory-mapped, so the optimizer states it also holds are never read into memory.
    Raises ValueError naming the file and what is wrong (``r3lightning.checkpointing.read.read_checkpoint``:
    missing, empty, truncated, damaged, not an r3lightning checkpoint; here also no ModelConfig).
    """
    checkpoint = read_checkpoint(ckpt_path)
    model_config = checkpoint.get("hyper_parameters", {}).get("model")
    if isinstance(model_config, dict):
        # ``r3l fit`` (LightningCLI) saves the init arguments as plain dicts.
        try:
            tiny = TinyModelSpec(**model_config.get("tiny", {}))
            model_config = ModelConfig(**{**model_config, "tiny": tiny})
        except TypeError as err:
            raise ValueError(f"checkpoint {ckpt_path!r}: hyper_parameters['model'] is not a ModelConfig ({err})") from err
        checkpoint["hyper_parameters"]["model"] = model_config
    if not isinstance(model_config, ModelConfig):
        raise ValueError(f"checkpoint {ckpt_path!r} has no ModelConfig in hyper_parameters['model']")
    return checkpoint


def policy_state_dict(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The ``policy.*`` tensors of a module state dict, prefix removed (the reference is left out)."""
    prefix = "policy."
    return {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}


def _main_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype holding most parameters (the base weights; LoRA adapters may be wider)."""
    sizes: dict[torch.dtype, int] = {}
    for tensor in state.values():
        if tensor.is_floating_point():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    return max(sizes, key=sizes.get)


def rebuild_policy(checkpoint: dict[str, Any], ckpt_path: str):
    """(policy with the checkpoint's weights, tokenizer): the architecture rebuilt from the saved
    ModelConfig, LoRA-wrapped as in training, every ``policy.*`` tensor loaded (strictly)."""
    config: ModelConfig = checkpoint["hyper_parameters"]["model"]
    saved = checkpoint["r3lightning"]
    if config.pretrained:
        model, tokenizer = load_pretrained(config)
        # Loaded again from name_or_path, the tokenizer must still be the one the policy was trained with.
        if tokenizer_fingerprint(tokenizer) != saved.get("tokenizer_fingerprint"):
            raise ValueError(
                f"checkpoint {ckpt_path!r}: the tokenizer at {config.name_or_path or config.gguf_file!r} differs from the one it was "
                "trained with (has the model changed since?)"
            )
    else:
        if not saved.get("tokenizer_json"):
            raise ValueError(f"checkpoint {ckpt_path!r}: a tiny model's checkpoint without its tokenizer_json")
        tokenizer = tokenizer_from_json(saved["tokenizer_json"])
        model = build_tiny_model(config.tiny, tokenizer)
    state = policy_state_dict(checkpoint)
    if not state:
        raise ValueError(f"checkpoint {ckpt_path!r} has no policy.* weights")
    # Built in the trained dtype, loading rounds nothing; apply_lora adds the adapters training had.
    policy = apply_lora(model.to(_main_dtype(state)), config)
    try:
        policy.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(
            f"checkpoint {ckpt_path!r}: its policy weights do not fit the architecture rebuilt from its "
            f"ModelConfig ({err})"
        ) from err
    return policy.eval(), tokenizer


def load_policy(path: str):
    """(policy, tokenizer) of a model given by ``path``: a GGUF file (``*.gguf``: a path or an installed
    package's ``package/file.gguf``, as ``model.model.gguf_file`` takes it), an r3lightning checkpoint
    file (rebuilt as ``rebuild_policy`` does) or a Hugging Face model directory or id
    (``load_pretrained``). Used by ``r3l gnt-pool`` and ``r3l reflect-sft`` to run an expert or a critic."""
    if path.endswith(".gguf"):
        return load_pretrained(ModelConfig(gguf_file=path))
    if os.path.isfile(path):
        return rebuild_policy(load_checkpoint(path), path)
    return load_pretrained(ModelConfig(name_or_path=path))


def _set_generation_ids(model, tokenizer) -> None:
    """End generation at the tokenizer's end-of-turn token (the one the policy was trained to emit),
    keeping any end tokens the base model's own generation config already lists."""
    generation = model.generation_config
    existing = generation.eos_token_id
    existing = [] if existing is None else [existing] if isinstance(existing, int) else list(existing)
    eos = [tokenizer.eos_token_id] + [i for i in existing if i != tokenizer.eos_token_id]
    generation.eos_token_id = eos[0] if len(eos) == 1 else eos
    generation.pad_token_id = tokenizer.pad_token_id


def _check_out_dir(out_dir: str) -> None:
    """Refuse a non-empty ``out_dir``: leftovers (say an ``adapter_config.json`` from an earlier export,
    which ``from_pretrained`` would apply on top) would mix with this export."""
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise ValueError(f"out: {out_dir!r} exists and is not an empty directory")


def _why_not(path: str, err: OSError) -> str:
    """Why ``path`` could not be created or written: a file where a directory of it must be, or the error."""
    ancestor = os.path.abspath(path)
    while not os.path.exists(ancestor) and os.path.dirname(ancestor) != ancestor:
        ancestor = os.path.dirname(ancestor)
    if ancestor != os.path.abspath(path) and not os.path.isdir(ancestor):
        return f"{ancestor!r} is a file, not a directory"
    return err.strerror or str(err)


def check_writable_directory(directory: str, what: str) -> None:
    """Create ``directory`` if needed and check that a file can be written in it; an ``OSError`` naming
    ``what`` and the directory otherwise (so a run finds out at set-up, not at its first export)."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise OSError(f"{what} {directory!r} is not writable: {_why_not(directory, err)}") from None


def export_checkpoint(ckpt_path: str, out_dir: str, lora: LoraExport = "merged") -> str:
    """Write the policy of the r3lightning checkpoint ``ckpt_path`` to ``out_dir`` as a Hugging Face
    model directory; returns ``out_dir``.

    lora: ``merged`` (default) folds LoRA adapters into the base weights (peft ``merge_and_unload``),
        giving a plain model; ``adapter`` writes only the PEFT adapter (``adapter_config.json``,
        ``adapter_model.safetensors``) plus the tokenizer, for the base model at ``name_or_path``.
    """
    checkpoint = load_checkpoint(ckpt_path)
    config: ModelConfig = checkpoint["hyper_parameters"]["model"]
    check_export(config, lora, f"checkpoint {ckpt_path!r}")
    _check_out_dir(out_dir)
    policy, tokenizer = rebuild_policy(checkpoint, ckpt_path)
    del checkpoint  # its memory-mapped tensors were copied into the policy
    return export_policy(policy, tokenizer, config, out_dir, lora)


def check_export(config: ModelConfig, lora: LoraExport, source: str) -> None:
    """Refuse an export ``lora`` cannot give for a policy built from ``config`` (``source`` names it)."""
    if lora not in ("merged", "adapter"):
        raise ValueError(f"lora must be 'merged' or 'adapter', got {lora!r}")
    if lora == "adapter" and config.lora_rank <= 0:
        raise ValueError(f"{source} has no LoRA adapter (lora_rank 0): export with lora='merged'")
    if lora == "adapter" and not config.pretrained:
        raise ValueError(
            f"{source}: its base model is a tiny model built in memory, which no adapter can refer to; "
            "export with lora='merged'"
        )


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _apply_umask(top: str) -> None:
    """Give ``top`` and what is under it the modes a plain ``mkdir``/``open`` would (0777/0666 less the
    umask): ``tempfile.mkdtemp`` makes the staging directory 0700, which would keep the export from
    other users (a serving process under another account)."""
    mask = _current_umask()
    os.chmod(top, 0o777 & ~mask)
    for root, dirs, files in os.walk(top):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _size_of_weights(policy) -> int:
    """Bytes of the policy's parameters and buffers: about what ``model.safetensors`` takes."""
    tensors = [*policy.parameters(), *policy.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _megabytes(size: float) -> str:
    return f"{size / 2**20:,.1f} MB"


def _write_error(err: BaseException) -> str:
    """An ``OSError``'s reason; safetensors' ``SafetensorError`` (raised when the weights do not fit)
    carries the operating system's text inside its own."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    text = " ".join(str(err).split())
    return "No space left on device" if "os error 28" in text or "No space left" in text else text


def export_policy(policy, tokenizer, config: ModelConfig, out_dir: str, lora: LoraExport = "merged", who: str = "") -> str:
    """Write ``policy`` (built from ``config``, LoRA-wrapped when ``config.lora_rank > 0``) and its
    ``tokenizer`` to the empty or new directory ``out_dir``; returns ``out_dir``. Merging consumes the
    LoRA wrapper: pass a copy of a policy that goes on training.

    The files are written into a temporary directory beside ``out_dir`` and renamed to it when all are
    written: a full disk, a missing permission or a kill leaves no half-written model (say a
    ``config.json`` without weights) at ``out_dir``. The directory and its files take the user's umask.
    A failed write (an ``OSError``, or safetensors' ``SafetensorError`` when the weights do not fit) is
    re-raised as one ``OSError`` line naming ``out_dir`` (after ``who``, the callback, when given) and,
    for a full disk, the space the weights need and what is free; the temporary directory is removed."""
    _check_out_dir(out_dir)
    prefix = f"{who}: " if who else ""
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.", suffix=".partial", dir=parent)
    except OSError as err:
        raise OSError(f"{prefix}cannot write {out_dir!r}: {_why_not(out_dir, err)}") from None
    try:
        if lora == "adapter":
            policy.save_pretrained(staging, safe_serialization=True)
        else:
            model = policy.merge_and_unload() if config.lora_rank > 0 else policy
            _set_generation_ids(model, tokenizer)
            model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        _apply_umask(staging)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above): the rename below takes its place
        os.rename(staging, out_dir)
    except (OSError, SafetensorError) as err:
        shutil.rmtree(staging, ignore_errors=True)
        reason = _write_error(err)
        if reason == "No space left on device":
            free = shutil.disk_usage(parent).free
            reason += f" (the weights alone need about {_megabytes(_size_of_weights(policy))}; {_megabytes(free)} free in {parent!r})"
        raise OSError(f"{prefix}writing {out_dir!r} failed: {reason}; nothing was left there") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
