"""Class paths that moved when the package was split into layers (docs/design.md): a config or command
line that names one by its old module is refused before parsing with the new path, as moved keys are
(jsonargparse would answer with a union message that never says where the class went)."""

from __future__ import annotations

import re
import sys
from typing import Optional

MOVED_MODULES = {
    "r3lightning.checkpoint_io": "r3lightning.checkpointing.io",
    "r3lightning.checkpoints": "r3lightning.training.checkpoint_state",
    "r3lightning.export": "r3lightning.checkpointing.export",
    "r3lightning.models": "r3lightning.training.models",
    "r3lightning.optim": "r3lightning.training.optim",
    "r3lightning.resume_check": "r3lightning.checkpointing.resume",
    "r3lightning.state_checks": "r3lightning.data.state_checks",
    "r3lightning.data.gnt_pool": "r3lightning.data.reflectrl.gnt_pool",
    "r3lightning.data.reflective_sft": "r3lightning.data.reflectrl.reflective_sft",
    "r3lightning.rollout.critique_refine": "r3lightning.rollout.explorers.critique_refine",
    "r3lightning.rollout.in_context": "r3lightning.rollout.explorers.in_context",
    "r3lightning.rollout.reflect_from_scratch": "r3lightning.rollout.explorers.reflect_from_scratch",
    "r3lightning.rollout.reflect_retry": "r3lightning.rollout.explorers.reflect_retry",
    "r3lightning.rollout.reflection": "r3lightning.rollout.explorers.reflection",
    "r3lightning.rollout.engine": "r3lightning.engines.base",
    "r3lightning.rollout.engine_config": "r3lightning.engines.config",
    "r3lightning.rollout.hf_engine": "r3lightning.engines.hf.engine",
    "r3lightning.rollout.vllm_engine": "r3lightning.engines.vllm.engine",
    "r3lightning.rollout.sampling": "r3lightning.engines.hf.sampling",
}
"""Old module -> new module, from the renames of the package split (``git log --diff-filter=R``)."""

CLASS_PATH = re.compile(r"\br3lightning(?:\.[A-Za-z_]\w*)+")


def moved_class_path(path: str) -> Optional[str]:
    """The new spelling of ``module.Class`` when ``module`` is an old module of ``MOVED_MODULES``."""
    module, _, name = path.rpartition(".")
    return f"{MOVED_MODULES[module]}.{name}" if module in MOVED_MODULES and name else None


def _config_paths(args: list[str]) -> list[str]:
    return [args[i + 1] for i, arg in enumerate(args[:-1]) if arg in ("--config", "-c")] + [
        arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")
    ]


def check_moved_class_paths(args: list) -> None:
    """Exit 2 with ``r3l: error: <where>: <old> moved to <new>`` when a command-line value or a
    ``--config`` file names a class by a moved module's path; ``where`` is the argument, or the file and line."""
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
            new = moved_class_path(found)
            if new is not None:
                print(f"r3l: error: {where}: {found} moved to {new} (the package was split into layers, "
                      "docs/design.md); use the new path", file=sys.stderr)
                raise SystemExit(2)
