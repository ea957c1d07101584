"""A callback for ``tests/callbacks/test_checkpointing.py`` that holds a training step open: at the
optimizer step of ``at_step`` (after the rollout and the backward pass, before the update) it writes
``ready_file`` and waits until a signal has been received (``StepCheckpoint.signal_received``), so the
test's SIGTERM arrives while that step is running. Named by class path in the ``r3l fit`` subprocess
(its folder is on the subprocess's ``PYTHONPATH``)."""

import time
from pathlib import Path

import lightning as L


class PauseMidStep(L.Callback):
    def __init__(self, ready_file: str, at_step: int = 3, timeout_s: float = 60.0) -> None:
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
