"""What the module's checkpoints hold beyond the weights, and the checks before Lightning restores any of it.

The module writes its ``r3lightning`` section (phase, weight version, skipped steps, tokenizer
fingerprint: ``r3lightning_section``) and, on load, refuses a checkpoint that does not fit the run
(``check_loadable``). Its config dataclasses are allowed in torch's safe loader (``allow_in_checkpoints``).

A resume also restores the data module's state (task cursor, R³ replay buffer), ReflectRL's
distillation state (``r3lightning.distill``: its teacher) and every callback's state (health history,
phase report). A damaged or foreign field would otherwise
surface as a ``KeyError`` / ``AttributeError`` traceback from inside Lightning's restore, or as "invalid
literal for int()" naming no file. ``check_checkpoint_state`` checks them all first and raises one
``ValueError`` naming the checkpoint and the field. Callbacks take part through a
``check_state_dict(state)`` method that raises ``ValueError("<field>: <problem>")`` (this layer sits
below the callbacks, so it asks the trainer's instances).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, get_args

import torch

from r3lightning.data.state_checks import expect_int, expect_type
from r3lightning.training.distillation import Distillation, saved_state
from r3lightning.training.models import tokenizer_fingerprint
from r3lightning.training.phases import PhaseName, PhaseSchedule

PHASES: tuple[str, ...] = get_args(PhaseName)
"""The values of the ``r3lightning`` section's ``phase``: the phases' names (``training.phases``)."""


def check_r3lightning_section(section: Any) -> None:
    """The module's own section (``r3lightning_section``): phase, weight version, skipped steps."""
    expect_type(section, dict, "r3lightning")
    if "phase" in section and section["phase"] not in PHASES:
        raise ValueError(f"r3lightning.phase: {section['phase']!r} is not one of {', '.join(PHASES)}")
    for key in ("weight_version", "skipped_steps"):
        if key in section:
            expect_int(section[key], f"r3lightning.{key}")


def check_checkpoint_state(checkpoint: dict[str, Any], path: Optional[str], trainer: Any = None) -> None:
    """Refuse a checkpoint whose restorable state is damaged, with one line naming ``path`` and the field.

    Checks the ``r3lightning`` section, the distillation's state (``training.distillation.saved_state``),
    the data module's section (under its class name, Lightning's key) and, with a ``trainer``, the
    state of each of its callbacks that has a ``check_state_dict``.
    """
    from r3lightning.data.datamodule import RolloutDataModule

    name = path if path else "(in memory)"
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    data_keys = {RolloutDataModule.__qualname__, *([type(datamodule).__qualname__] if datamodule is not None else [])}
    try:
        if "r3lightning" in checkpoint:
            check_r3lightning_section(checkpoint["r3lightning"])
        distill, where = saved_state(checkpoint)
        if distill is not None:
            try:
                Distillation.check_state_dict(distill)
            except ValueError as err:
                raise ValueError(f"{where}.{err}") from None
        for key in sorted(data_keys & set(checkpoint)):
            try:
                RolloutDataModule.check_state_dict(checkpoint[key])
            except ValueError as err:
                raise ValueError(f"{key}.{err}") from None
        states = checkpoint.get("callbacks", {})
        if trainer is not None and states:
            expect_type(states, dict, "callbacks")
            for callback in getattr(trainer, "callbacks", []):
                key = getattr(callback, "state_key", None)
                if key in states and hasattr(callback, "check_state_dict"):
                    try:
                        expect_type(states[key], dict, "state")
                        callback.check_state_dict(states[key])
                    except ValueError as err:
                        raise ValueError(f"callbacks[{key!r}].{err}") from None
    except ValueError as err:
        raise ValueError(f"checkpoint {name!r}: damaged state, {err}") from None


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


def check_loadable(checkpoint: dict[str, Any], own: dict[str, torch.Tensor], tokenizer, phases: PhaseSchedule) -> dict[str, Any]:
    """Refuse a checkpoint that does not fit this run (tokenizer, parameter shapes, missing weights),
    and fill in a missing KL reference where this run's own is the right one. Returns the checkpoint's
    ``r3lightning`` section. ``own``: the module's state dict; ``phases``: this run's schedule."""
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
        if phases.past_warmstart(checkpoint.get("global_step", 0)):
            raise ValueError(
                f"checkpoint: it has no reference model (trained with kl_coef 0) and is past the warm-start "
                f"(step {checkpoint['global_step']} > model.phases.warmstart.steps {phases.rl_start}), so the "
                "warm-started policy the KL should anchor to is not in it. Resume with kl_coef: 0, or from a "
                f"checkpoint saved by step {phases.rl_start}."
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
