"""Checkpoints that lose no work: every N optimizer steps, at the end of ``fit``, and on SIGTERM/SIGINT
at a step boundary, always with an up-to-date ``last.ckpt`` (docs/reliability.md)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from torch.optim.optimizer import register_optimizer_step_pre_hook

from r3lightning.checkpointing.io import (
    LAST_CHECKPOINT,
    atomic_link,
    find_last_checkpoints,
    remove_stale_partials,
    trainer_last_checkpoint_places,
)

STOP_SIGNALS = ("SIGTERM", "SIGINT")


class StopNow(KeyboardInterrupt):
    """Raised by ``StepCheckpoint``'s handler on a second SIGTERM or SIGINT: it ends the step that is
    running at the next Python instruction (within a decoding step or a micro-batch), the way Ctrl-C
    does, and Lightning stops training through its interrupt path (``on_exception``)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class StepCheckpoint(ModelCheckpoint):
    """Save ``<log_dir>/checkpoints/last.ckpt`` every ``every_n_steps`` optimizer steps, after the last
    step of ``fit`` (and whenever training stops early), independently of validation, and stop cleanly
    on SIGTERM or SIGINT.

    Each save writes ``last.ckpt`` (atomically when ``r3l``'s ``AtomicCheckpointIO`` is installed, as
    it is by default) and names the same file ``step=<N>.ckpt`` (a hard link: no second copy on
    disk); the ``keep`` newest step files are kept. ``r3l`` adds this callback unless the config
    names a ``ModelCheckpoint`` of its own (this class is one, so name it to change its settings) or
    sets ``trainer.enable_checkpointing: false``.

    On the first SIGTERM or SIGINT (Ctrl-C) during training, the step that is running finishes,
    ``last.ckpt`` is saved at that step boundary, validation is skipped and ``fit`` returns;
    ``stopped_by_signal`` then holds the signal's name and ``r3l`` exits with status 128 + its number
    (143 for SIGTERM, 130 for SIGINT). A second signal stops at once: its handler raises ``StopNow`` (a
    ``KeyboardInterrupt``), which ends the step that is running within the decoding step or micro-batch
    in progress; the step is dropped, ``HealthWatchdog`` saves ``exception.ckpt`` unless a checkpoint
    of the same step exists (one file per event), and ``r3l`` exits 128 + the signal's number. Its line
    says what is written, or that nothing is, and which file to resume from. Only the update itself is
    not cut (an optimizer step half-applied would damage the weights): a second signal that arrives
    once the step's optimizer step has begun lets the step end and saves ``last.ckpt`` there, as the
    first one does. Temporary files of saves that never finished (a SIGKILL during a save) are removed
    when training starts.
    Under several ranks the decision is shared (any rank's signal stops every rank after the same
    step).

    Args:
        every_n_steps: save every this many optimizer steps (global steps); 0 saves only at the end
            of ``fit`` and on a signal.
        keep: how many ``step=<N>.ckpt`` names to keep besides ``last.ckpt`` (0: none, -1: all).
        dirpath: directory of the checkpoints (default ``<log_dir>/checkpoints``).
        stop_on_signal: catch SIGTERM and SIGINT during training as described above.
    """

    def __init__(self, every_n_steps: int = 50, keep: int = 1, dirpath: Optional[str] = None, stop_on_signal: bool = True) -> None:
        if every_n_steps < 0:
            raise ValueError(f"StepCheckpoint: every_n_steps must be >= 0, got {every_n_steps}")
        if keep < -1:
            raise ValueError(f"StepCheckpoint: keep must be -1 (all), 0 or more, got {keep}")
        super().__init__(dirpath=dirpath, filename="{step}", save_top_k=0, enable_version_counter=False)
        self.every_n_steps = every_n_steps
        self.keep = keep
        self.stop_on_signal = stop_on_signal
        self.stopped_by_signal: Optional[str] = None
        self.signal_received: Optional[str] = None
        self.interrupted_by: Optional[str] = None
        """The signal sent a second time, which stopped training at once (``r3l`` exits 128 + its number)."""
        self._resumed_from: Optional[str] = None
        self._previous_handlers: dict[int, Any] = {}
        self._step_files: list[str] = []
        self._trainer: Optional[L.Trainer] = None
        self._updating = False  # from the step's optimizer step to its end: a second signal does not cut it
        self._update_hook = None

    @property
    def state_key(self) -> str:
        return "StepCheckpoint"  # one per trainer; the same key whatever its settings, so a resume may change them

    # ---- where ----------------------------------------------------------------------------------
    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        """``trainer.fit(ckpt_path="last")`` finds the newest ``last.ckpt`` of every version of the
        run, not only of the current (new, empty) version folder."""
        own = [str(self.dirpath)] if self.dirpath is not None else []
        return set(find_last_checkpoints(trainer_last_checkpoint_places(trainer, own)))

    # ---- when -----------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.stopped_by_signal = None
        self.signal_received = None
        self.interrupted_by = None
        self._resumed_from = str(trainer.ckpt_path) if trainer.ckpt_path else None
        if trainer.is_global_zero:
            own = [str(self.dirpath)] if self.dirpath is not None else []
            removed = remove_stale_partials([*trainer_last_checkpoint_places(trainer, own), *own])
            if removed:
                _print(f"[r3lightning] removed {len(removed)} partial checkpoint file(s) of saves that never finished: {', '.join(removed)}")
        self._trainer = trainer
        self._updating = False
        if self.stop_on_signal and threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                signum = getattr(signal, name)
                self._previous_handlers[signum] = signal.getsignal(signum)
                signal.signal(signum, self._on_signal)
            self._update_hook = register_optimizer_step_pre_hook(self._on_update)

    def _on_update(self, optimizer, args, kwargs) -> None:
        self._updating = True  # until on_train_batch_end: the weights are changing, then the step is whole

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_received is not None:  # a second signal: stop now
            self.interrupted_by = name
            trainer = self._trainer
            step = trainer.global_step if trainer is not None else 0
            if self._updating:
                _print(
                    f"[r3lightning] {name} again: the step that is running has begun its update, which is not cut (it would "
                    f"damage the weights); stopping as soon as that step ends, saving {self._last_path()}"
                )
                return
            self._restore_handlers()
            where = f"the validation after global step {step}" if trainer is not None and trainer.validating else f"global step {step + 1}"
            _print(f"[r3lightning] {name} again: stopping now, inside {where} (dropped); {self._stop_now_plan()}")
            raise StopNow(name)
        self.signal_received = name
        _print(
            f"[r3lightning] {name} received: finishing the current step, then saving {LAST_CHECKPOINT} "
            f"(send {name} again to stop at once)."
        )

    def _last_path(self) -> str:
        return os.path.join(str(self.dirpath), LAST_CHECKPOINT) if self.dirpath is not None else LAST_CHECKPOINT

    def _stop_now_plan(self) -> str:
        """What a second signal's stop writes, from the health watchdog that writes it (one file per
        event), and which checkpoint to resume from; files named only when they exist or are being written."""
        trainer = self._trainer
        watchdog = next((c for c in trainer.callbacks if hasattr(c, "exception_save_plan")), None) if trainer else None
        if watchdog is not None:
            path, what = watchdog.exception_save_plan(trainer)
            if path or "resume" in what:
                return what
        else:
            what = "writing nothing (no HealthWatchdog saves an exception checkpoint)"
        if self.last_model_path and os.path.isfile(self.last_model_path):
            return f"{what}; resume from {self.last_model_path} (global step {self._last_global_step_saved}) with --ckpt_path {self.last_model_path}"
        if self._resumed_from and os.path.isfile(self._resumed_from):
            return f"{what}; resume from {self._resumed_from}, which this run started from"
        return f"{what}; this run has no checkpoint to resume from"

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            try:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            except (ValueError, TypeError):  # not the main thread, or a handler set from C
                pass
        self._previous_handlers = {}
        if self._update_hook is not None:
            self._update_hook.remove()
            self._update_hook = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        try:
            self._end_step(trainer)
        finally:
            self._updating = False  # the step is whole (and saved, if it stops here): a second signal cuts the next one

    def _end_step(self, trainer: L.Trainer) -> None:
        stop = self.signal_received is not None
        if self.stop_on_signal and trainer.world_size > 1:
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)  # every rank calls this every step
        step = trainer.global_step
        last_step = trainer.max_steps is not None and 0 < trainer.max_steps <= step
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        if (periodic or last_step or stop or trainer.should_stop) and not self._already_saved(trainer):
            self.save(trainer)
        if stop and not last_step:
            self.stopped_by_signal = self.signal_received or "a signal on another rank"
            trainer.should_stop = True
            epoch_loop = trainer.fit_loop.epoch_loop
            if hasattr(epoch_loop, "_skip_next_val"):  # stopping is not a reason to validate here
                epoch_loop._skip_next_val = True
            _print(
                f"[r3lightning] stopped by {self.stopped_by_signal} after global step {step} (a step boundary); "
                f"saved {self.last_model_path}. Resume with: r3l fit <the same config> --ckpt_path last"
            )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass  # saves follow steps, not epochs (the task stream is one endless epoch)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass  # nor validation

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Training ended some other way (``max_time``, a callback's ``should_stop`` after this
        callback's hook): save the final state unless this step is saved already."""
        if not self._already_saved(trainer):
            self.save(trainer)
        self._restore_handlers()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A step that died half-way is no step boundary: last.ckpt stays the last consistent state
        # (HealthWatchdog saves exception.ckpt).
        self._restore_handlers()

    def _already_saved(self, trainer: L.Trainer) -> bool:
        return trainer.global_step == 0 or self._last_global_step_saved == trainer.global_step or bool(trainer.fast_dev_run)

    # ---- how ------------------------------------------------------------------------------------
    def save(self, trainer: L.Trainer) -> str:
        """Save ``last.ckpt`` now (collective under several ranks) and name it ``step=<N>.ckpt``."""
        candidates = self._monitor_candidates(trainer)
        last = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST)
        self.last_model_path = last
        self._save_checkpoint(trainer, last)
        if self.keep != 0 and trainer.is_global_zero and os.path.isfile(last):
            step_file = self.format_checkpoint_name(candidates)
            atomic_link(last, step_file)
            self.best_model_path = step_file
            self._step_files = [f for f in self._step_files if f != step_file] + [step_file]
            while self.keep > 0 and len(self._step_files) > self.keep:
                old = self._step_files.pop(0)
                try:
                    os.remove(old)
                except OSError:
                    pass
        trainer.strategy.barrier()
        return last

    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": str(self.dirpath)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the resumed run writes its own files (the step files of the run it
        resumed from stay where they are; only this run's are rotated)."""


@rank_zero_only
def _print(message: str) -> None:
    print(message, flush=True)
