"""Class paths that moved when the package was split into layers (docs/design.md): a config or command
line that names one by its old module is refused before parsing with the new path, as moved keys are
(jsonargparse would answer with a union message that never says where the class went). A callback that
became a phase of the schedule (``REPLACED_CALLBACKS``) is refused the same way, naming its keys."""

from __future__ import annotations

import re
import sys
from typing import Optional

from r3lightning.training.phases import REPLACED_CALLBACKS

PACKAGE = "r3lightning"
RENAMED = {
    "checkpoint_io": "checkpointing.io",
    "checkpoints": "training.checkpoint_state",
    "export": "checkpointing.export",
    "models": "training.models",
    "optim": "training.optim",
    "resume_check": "checkpointing.resume",
    "state_checks": "data.state_checks",
    "data.gnt_pool": "data.reflectrl.gnt_pool",
    "data.reflective_sft": "data.reflectrl.reflective_sft",
    "rollout.critique_refine": "rollout.explorers.critique_refine",
    "rollout.in_context": "rollout.explorers.in_context",
    "rollout.reflect_from_scratch": "rollout.explorers.reflect_from_scratch",
    "rollout.reflect_retry": "rollout.explorers.reflect_retry",
    "rollout.reflection": "rollout.explorers.reflection",
    "rollout.engine": "engines.base",
    "rollout.engine_config": "engines.config",
    "rollout.hf_engine": "engines.hf.engine",
    "rollout.vllm_engine": "engines.vllm.engine",
    "rollout.sampling": "engines.hf.sampling",
}
"""Old module -> new module within ``PACKAGE``, from the renames of the package split (``git log --diff-filter=R``);
spelled relative to the package because the old modules no longer exist (nothing here imports them)."""
MOVED_MODULES = {f"{PACKAGE}.{old}": f"{PACKAGE}.{new}" for old, new in RENAMED.items()}

CLASS_PATH = re.compile(r"\br3lightning(?:\.[A-Za-z_]\w*)+")


def moved_class_path(path: str) -> Optional[str]:
    """The new spelling of ``module.Class`` when ``module`` is an old module of ``MOVED_MODULES``."""
    module, _, name = path.rpartition(".")
    return f"{MOVED_MODULES[module]}.{name}" if module in MOVED_MODULES and name else None


def _config_paths(args: list[str]) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg in ("--config", "-c")] + [
        arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")
    ]


def replaced_class_note(path: str) -> Optional[str]:
    """What to set instead of a callback that became a phase of the schedule (``REPLACED_CALLBACKS``), for
    ``path`` spelled through ``r3lightning.callbacks`` or its old module."""
    module, _, name = path.rpartition(".")
    callbacks = f"{PACKAGE}.callbacks"
    if name in REPLACED_CALLBACKS and (module == callbacks or module.startswith(callbacks + ".")):
        return f"{callbacks}.{name} was replaced by the phase {REPLACED_CALLBACKS[name]}"
    return None


def check_moved_class_paths(args: list) -> None:
    """Exit 2 with ``r3l: error: <where>: <old> moved to <new>`` when a command-line value or a
    ``--config`` file names a class by a moved module's path, and with the keys to set instead when it
    names a callback that became a phase (``REPLACED_CALLBACKS``); ``where`` is the argument, or the
    file and line."""
    if not isinstance(args, (list, tuple)):
        return
    args = [str(a) for a in args]
    places = [("the command line", arg) for arg in args]
    for path in _config_paths(args):
        try:
            with open(path) as handle:
                places += [(f"config file {path!r}, line {n}", line) for n, line in enumerate(handle, start=1)]
        except OSError:
            continue  # a missing file is reported by the parser
    for where, text in places:
        for found in CLASS_PATH.findall(text):
            replaced = replaced_class_note(found)
            if replaced is not None:
                print(f"r3l: error: {where}: {replaced}", file=sys.stderr)
                raise SystemExit(2)
            new = moved_class_path(found)
            if new is not None:
                print(f"r3l: error: {where}: {found} moved to {new} (the package was split into layers, "
                      "docs/design.md); use the new path", file=sys.stderr)
                raise SystemExit(2)
