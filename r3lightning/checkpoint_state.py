"""What a checkpoint restores beyond the weights, checked before Lightning restores any of it.

A resume restores the module's ``r3lightning`` section (phase, weight version, skipped steps), the
data module's state (task cursor, R³ replay buffer) and every callback's state (health history,
distillation teacher, phase report). A damaged or foreign field would otherwise surface as a
``KeyError`` / ``AttributeError`` traceback from inside Lightning's restore, or as "invalid literal for
int()" naming no file. ``check_checkpoint_state`` checks them all first and raises one ``ValueError``
naming the checkpoint and the field. Callbacks take part through a ``check_state_dict(state)`` method
that raises ``ValueError("<field>: <problem>")`` (the package never imports the callbacks, so it asks
the trainer's instances).
"""

from __future__ import annotations

from typing import Any, Optional

from r3lightning.state_checks import expect_int, expect_type

PHASES = ("sft", "rl")
"""The values of the ``r3lightning`` section's ``phase``."""


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

    Checks the ``r3lightning`` section, the data module's section (under its class name, Lightning's
    key) and, with a ``trainer``, the state of each of its callbacks that has a ``check_state_dict``.
    """
    from r3lightning.data.datamodule import RolloutDataModule

    name = path if path else "(in memory)"
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    data_keys = {RolloutDataModule.__qualname__, *([type(datamodule).__qualname__] if datamodule is not None else [])}
    try:
        if "r3lightning" in checkpoint:
            check_r3lightning_section(checkpoint["r3lightning"])
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
