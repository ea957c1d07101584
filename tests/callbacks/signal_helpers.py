"""Callbacks for ``tests/callbacks/test_checkpointing.py`` that hold a training step open: at the
optimizer step of ``at_step`` (after the rollout and the backward pass, before the update) they write
``ready_file`` and wait, so the test's signals arrive while that step is running. Named by class path in
the ``r3l fit`` subprocess (their folder is on the subprocess's ``PYTHONPATH``)."""

import time
from pathlib import Path

import lightning as L


class PauseMidStep(L.Callback):
    """Holds step ``at_step`` open until a signal has been received (``StepCheckpoint.signal_received``).
    The time limit is long on purpose: on a loaded machine the test's signal can take over a minute, and
    a step that closed first would be saved and change what the test sees."""

    def __init__(self, ready_file: str, at_step: int = 3, timeout_s: float = 600.0) -> None:
        self.ready_file = ready_file
        self.at_step = at_step
        self.timeout_s = timeout_s
        self.paused = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.paused or trainer.global_step != self.at_step - 1:
            return
        self.paused = True
        Path(self.ready_file).write_text(str(trainer.global_step))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if any(getattr(c, "signal_received", None) for c in trainer.callbacks):
                return
            time.sleep(0.02)


class HoldMidStep(L.Callback):
    """Like ``PauseMidStep``, but the step stays open after the first signal (``seen_file`` is written
    then) until a second one (``interrupted_by``), so both arrive while the step's update is under way."""

    def __init__(self, ready_file: str, seen_file: str, at_step: int = 3, timeout_s: float = 600.0) -> None:
        self.ready_file, self.seen_file = ready_file, seen_file
        self.at_step = at_step
        self.timeout_s = timeout_s

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != self.at_step - 1:
            return
        Path(self.ready_file).write_text(str(trainer.global_step))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and not any(getattr(c, "interrupted_by", None) for c in trainer.callbacks):
            if any(getattr(c, "signal_received", None) for c in trainer.callbacks) and not Path(self.seen_file).exists():
                Path(self.seen_file).write_text("seen")
            time.sleep(0.02)


class HoldInRollout(L.Callback):
    """Holds step ``at_step``'s rollout inside a decoding step (a forward hook on the policy's input
    embeddings, which every decoding path and every training forward calls): writes ``ready_file`` and
    waits for a first signal (``signal_received``), writes ``seen_file`` and waits for the second one
    (``interrupted_by``). Every embedding call after the second signal then adds a line to ``after_file``:
    the decoding steps and training forwards the run still made before it stopped."""

    def __init__(self, ready_file: str, seen_file: str, after_file: str, at_step: int = 3, timeout_s: float = 600.0) -> None:
        self.ready_file, self.seen_file, self.after_file = ready_file, seen_file, after_file
        self.at_step = at_step
        self.timeout_s = timeout_s
        self.held = False
        self.handle = None

    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        def hook(module, inputs):
            if self.held:
                with open(self.after_file, "a") as out:
                    out.write(f"{trainer.global_step}\n")
                return
            if trainer.global_step != self.at_step - 1 or torch.is_grad_enabled():
                return  # not the held step's rollout
            self.held = True
            Path(self.ready_file).write_text(str(trainer.global_step))
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline and not any(getattr(c, "interrupted_by", None) for c in trainer.callbacks):
                if any(getattr(c, "signal_received", None) for c in trainer.callbacks) and not Path(self.seen_file).exists():
                    Path(self.seen_file).write_text("seen")
                time.sleep(0.02)
            Path(self.after_file).touch()

        self.handle = pl_module.policy.get_input_embeddings().register_forward_pre_hook(hook)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.handle is not None:
            self.handle.remove()
