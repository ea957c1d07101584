"""The ``r3l`` command. What it can answer without Lightning it answers here, in well under a second:
the command list (``r3l --help``), the refusal of LightningCLI's ``test`` and ``predict``, and
``r3l fit --help`` / ``r3l validate --help`` from a cache of their text. Everything else, and the first
help of each command after an install or an edit, goes to ``r3lightning.cli.main``: importing Lightning
(which imports torch, torchmetrics and transformers) and building the parser takes about 5 s.

This module imports only the standard library; ``r3lightning.cli.main`` is imported when a command runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import statistics
import sys
import time
from importlib import metadata, util
from pathlib import Path
from typing import Optional

COMMANDS = {
    "fit": "train as the config says: SFT warm-start, then RL (r3l fit --config RECIPE.yaml)",
    "validate": "play the validation tasks with a checkpoint (--ckpt_path) or a pretrained model",
    "export": "write a checkpoint's policy as a Hugging Face model directory (--ckpt_path X.ckpt --out DIR)",
    "gnt-pool": "ReflectRL: build the golden-negative pool from an expert's wrong answers",
    "reflect-sft": "ReflectRL: write the reflective SFT data of a golden-negative pool",
}
"""Every command of ``r3l`` and what it does (``r3l --help``)."""
LIGHTNING_COMMANDS = ("fit", "validate")
"""The commands LightningCLI parses (``R3LightningCLI.subcommands``); the others have their own parsers."""
REFUSED_COMMANDS = {
    "test": "there is no test split here: r3l validate --ckpt_path CKPT plays the validation tasks",
    "predict": "r3l export --ckpt_path CKPT --out DIR writes the policy as a Hugging Face model to generate with",
}
"""LightningCLI's commands that have no meaning for r3lightning, and what to use instead."""
HELP_FLAGS = ("-h", "--help")
CACHE_FINGERPRINT_PACKAGES = ("lightning", "jsonargparse", "torch", "transformers", "peft")
"""Installed packages whose versions change the text of ``r3l fit --help`` (the classes it documents)."""


def top_level_help() -> str:
    width = max(len(name) for name in COMMANDS) + 2
    lines = [
        f"usage: r3l {{{','.join(COMMANDS)}}} ...",
        "",
        "r3lightning: reinforcement learning of language models with reflection (R3L, R3, ReflectRL, GRPO family).",
        "",
        "commands:",
        *(f"  {name:<{width}}{text}" for name, text in COMMANDS.items()),
        "",
        "r3l COMMAND --help lists the command's options; r3l fit --config RECIPE.yaml --print_config shows a",
        "whole resolved config.",
    ]
    return "\n".join(lines) + "\n"


def cache_dir() -> Path:
    """Where help texts are cached: ``$R3L_CACHE_DIR``, else ``$XDG_CACHE_HOME/r3lightning``, else
    ``~/.cache/r3lightning``."""
    if os.environ.get("R3L_CACHE_DIR"):
        return Path(os.environ["R3L_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "r3lightning"


def source_dirs() -> list[Path]:
    """The folders of r3lightning's code (the package and its callbacks, installed from ``callbacks/``),
    found without importing them."""
    dirs = [Path(__file__).resolve().parents[1]]  # this file is r3lightning/cli/console.py
    spec = util.find_spec("r3lightning.callbacks")
    if spec is not None and spec.origin:
        dirs.append(Path(spec.origin).parent)
    return dirs


def help_cache_key(args: list[str], dirs: list[Path], columns: int) -> str:
    """A digest of what the text of ``r3l <args>`` depends on: the arguments, the terminal width, the
    Python and ``CACHE_FINGERPRINT_PACKAGES`` versions, and the path, size and modification time of every
    ``.py`` file under ``dirs``. Any edit or upgrade gives a new key (a fresh help text)."""
    digest = hashlib.sha256()
    digest.update(repr((args, columns, sys.version, sys.executable)).encode())
    for package in CACHE_FINGERPRINT_PACKAGES:
        try:
            digest.update(f"{package}={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package}=absent".encode())
    for folder in dirs:
        for path in sorted(folder.rglob("*.py")):
            stat = path.stat()
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def cached_help(args: list[str], from_command_line: bool) -> Optional[str]:
    """The cached text of ``r3l fit --help`` (or ``validate``), building and caching it on a miss by
    running the real parser; None for any other arguments."""
    if len(args) != 2 or args[0] not in LIGHTNING_COMMANDS or args[1] not in HELP_FLAGS:
        return None
    columns = shutil.get_terminal_size().columns
    program = os.path.basename(sys.argv[0])  # the parser's "usage: <program> fit" line
    path = cache_dir() / f"help-{args[0]}-{help_cache_key([program, *args], source_dirs(), columns)}.txt"
    if path.is_file():
        return path.read_text()
    announce_wait_policy()
    from r3lightning.cli.main import main as lightning_main

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        try:
            lightning_main(None if from_command_line else args)
        except SystemExit as done:
            if done.code not in (0, None):
                raise
    text = captured.getvalue()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)
    except OSError:
        pass  # an unwritable cache only means the next help is built again
    return text


BUSY_LOAD = 0.5
"""The one-minute load average (runnable processes, before this one starts) from which the machine counts
as busy where the number running now cannot be read (no ``/proc/stat``)."""

BUSY_RUNNING = 1.0
"""Threads of other jobs running or ready to run now (``running_elsewhere``) from which the machine counts
as busy: another job holds a core, so this run's threads would outnumber the free ones."""


def running_elsewhere(samples: int = 11, interval_s: float = 0.01, stat_path: str = "/proc/stat") -> Optional[float]:
    """Threads running or ready to run on the machine now, not counting this process's reading thread: the
    median of ``samples`` reads of the kernel's ``procs_running``, ``interval_s`` apart (a short-lived
    command does not count). None where the count cannot be read.

    The one-minute load average is a decaying mean: for about a minute after another job ends it still
    counts that job, and a run started then would be judged to share the machine with it."""
    counts = []
    for index in range(samples):
        try:
            with open(stat_path) as stat:
                line = next((ln for ln in stat if ln.startswith("procs_running ")), None)
        except OSError:
            return None
        if line is None:
            return None
        counts.append(int(line.split()[1]) - 1)
        if index + 1 < samples:
            time.sleep(interval_s)
    return float(statistics.median(counts))


def choose_wait_policy(
    environ=os.environ, running: Optional[float] = None, load: Optional[float] = None
) -> Optional[str]:
    """On a busy machine, make OpenMP's idle threads sleep at once (``OMP_WAIT_POLICY=PASSIVE``) unless the
    user chose a policy; return the note to print, or None. Read once, when torch loads its OpenMP
    runtime, so it is decided before Lightning is imported. Busy: ``running`` (``running_elsewhere``,
    read when None) is ``BUSY_RUNNING`` or more; where that cannot be read, ``load`` (the one-minute load
    average, ``os.getloadavg``) is ``BUSY_LOAD`` or more.

    Every torch CPU operation splits its work over the threads and waits at a barrier for the last one.
    By default a thread that finished spins there. When another process holds a core (a second training
    run, an evaluation, data loading), the thread it displaced finishes a scheduler slice later while
    the spinning ones burn the CPU it needs, and every operation pays for it; sleeping threads give that
    CPU back. On a quiet machine the spinning is what keeps back-to-back small operations fast, so the
    policy is left as it is there (docs/engines.md, "Sharing the machine with other jobs", has both
    measurements)."""
    if "OMP_WAIT_POLICY" in environ:
        return None
    running = running_elsewhere() if running is None else running
    if running is not None:
        if running < BUSY_RUNNING:
            return None
        seen = f"{running:g} other threads running"
    else:
        load = os.getloadavg()[0] if load is None else load
        if load < BUSY_LOAD:
            return None
        seen = f"load average {load:.1f}"
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return (f"r3l: the machine is busy ({seen}): OpenMP threads sleep when idle "
            "(OMP_WAIT_POLICY=PASSIVE); set OMP_WAIT_POLICY to choose")


def announce_wait_policy() -> None:
    """``choose_wait_policy``, saying on stderr what it chose."""
    note = choose_wait_policy()
    if note:
        print(note, file=sys.stderr)


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``r3l`` script (``r3lightning.cli.main`` does the work of every command)."""
    # LightningCLI reads sys.argv itself; given the same arguments explicitly, it warns.
    from_command_line = args is None
    args = list(sys.argv[1:] if args is None else args)
    if not args or args[0] in HELP_FLAGS:
        print(top_level_help(), end="", file=sys.stdout if args else sys.stderr)
        raise SystemExit(0 if args else 2)
    if args[0] in REFUSED_COMMANDS:
        print(f"r3l: error: 'r3l {args[0]}' is not a command of r3l; {REFUSED_COMMANDS[args[0]]}", file=sys.stderr)
        raise SystemExit(2)
    text = cached_help(args, from_command_line)
    if text is not None:
        print(text, end="")
        return
    announce_wait_policy()
    from r3lightning.cli.main import main as lightning_main

    lightning_main(None if from_command_line else args)


if __name__ == "__main__":
    main()
