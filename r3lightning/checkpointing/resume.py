"""Resume that respects the user: where a checkpoint's saved ``model:`` settings and the parsed config
differ, and what ``r3l`` does about each kind of key (``--resume_with``; docs/reliability.md)."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any, Optional

from r3lightning.algos.objective import METHOD_FIELDS

SHAPE_KEYS = ("model.model.name_or_path", "model.model.gguf_file", "model.model.tiny", "model.model.lora_rank", "model.model.lora_target_modules")
"""Keys that define the weights' shapes or source: a checkpoint's weights only fit its own values."""
METHOD_KEYS = (
    *(f"model.algorithm.{name}" for name in METHOD_FIELDS),
    "model.model.dtype",
    "model.model.lora_alpha",
    "model.model.chat_template",
    "model.phases.warmstart.steps",
    "model.phases.rl.reset_optimizer",
)
"""Keys that define the method (the objective's ``METHOD_FIELDS``, the warm-start schedule, the policy's
dtype, LoRA scaling and chat template): a resume that changes one is a different run, done only on request."""


def plain(value: Any) -> Any:
    """``value`` as plain dicts, lists and scalars (config dataclasses and jsonargparse Namespaces too)."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    elif hasattr(value, "as_dict") and callable(value.as_dict):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _irrelevant(key: str, saved: dict[str, Any], parsed: dict[str, Any]) -> bool:
    """A difference that changes nothing: the tiny spec of a pretrained model, LoRA settings without LoRA."""
    both = lambda name: (saved.get(name), parsed.get(name))  # noqa: E731
    pretrained = lambda side: side.get("model.model.name_or_path") or side.get("model.model.gguf_file")  # noqa: E731
    if key.startswith("model.model.tiny.") and pretrained(saved) and pretrained(parsed):
        return True
    lora = ("model.model.lora_alpha", "model.model.lora_target_modules")
    return _under(key, lora) and not any(both("model.model.lora_rank"))


def resume_differences(saved_hparams: Any, parsed_model: Any) -> dict[str, list[tuple[str, Any, Any]]]:
    """Where a checkpoint's saved ``model:`` init arguments and the parsed ``model:`` section differ:
    ``{"shape": [...], "method": [...], "tuning": [...]}`` of ``(key, checkpoint value, config value)``,
    keys as ``r3l`` spells them (``model.algorithm.advantage``). Keys the checkpoint does not record
    (fields added since it was written) are left out."""
    saved = _flatten(plain(saved_hparams), "model")
    parsed = _flatten(plain(parsed_model), "model")
    found: dict[str, list[tuple[str, Any, Any]]] = {"shape": [], "method": [], "tuning": []}
    for key, value in parsed.items():
        if key not in saved or saved[key] == value or _irrelevant(key, saved, parsed):
            continue
        kind = "shape" if _under(key, SHAPE_KEYS) else "method" if _under(key, METHOD_KEYS) else "tuning"
        found[kind].append((key, saved[key], value))
    return found


def _listing(rows: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{key} (checkpoint: {old!r}, config: {new!r})" for key, old, new in rows)


def check_resume(ckpt_path: str, saved_hparams: Any, parsed_model: Any, resume_with: Optional[str]) -> tuple[bool, str]:
    """Decide a resume from ``ckpt_path`` whose saved ``model:`` section is ``saved_hparams``, under
    ``--resume_with``. Returns (apply the checkpoint's values?, a note to print or ""); raises ValueError
    (one line naming every differing key with both values) when the run cannot go on as configured.

    - default (None): shape or method keys that differ are an error; tuning keys (learning rate,
      micro-batching, engine, logging, ...) take the config's values, and the note lists them.
    - ``checkpoint``: every ``model:`` key takes the checkpoint's value; the note lists what it replaced.
    - ``config``: the config's values win, method keys included; shape keys still must match (the
      checkpoint's weights would not fit)."""
    diff = resume_differences(saved_hparams, parsed_model)
    where = f"--ckpt_path {ckpt_path!r}"
    if resume_with == "checkpoint":
        replaced = diff["shape"] + diff["method"] + diff["tuning"]
        note = f"[r3lightning] resume: the checkpoint's values replace the config's for {_listing(replaced)}" if replaced else ""
        return True, note
    if diff["shape"]:
        rows = diff["shape"] + diff["method"]
        hint = (
            "its weights cannot take this shape; resume with --resume_with checkpoint, or start a new run from "
            "its policy (r3l export, then model.model.name_or_path)"
            if resume_with == "config"
            else "resume with --resume_with checkpoint to take the checkpoint's values"
        )
        raise ValueError(f"{where}: the config differs from the checkpoint on the model's shape or source: {_listing(rows)}; {hint}")
    if diff["method"] and resume_with != "config":
        raise ValueError(
            f"{where}: the config differs from the checkpoint on keys that define the method: {_listing(diff['method'])}; "
            "resume with --resume_with checkpoint to take the checkpoint's values, or --resume_with config to "
            "continue its weights and optimizer under this config's method"
        )
    changed = diff["method"] + diff["tuning"]
    note = f"[r3lightning] resume: the config's values replace the checkpoint's for {_listing(changed)}" if changed else ""
    return False, note
