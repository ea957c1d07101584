"""Export the trained policy as a Hugging Face model directory during and at the end of ``fit``.

The same directory ``r3l export`` writes from a checkpoint (``r3lightning.checkpointing.export.export_policy``), taken
from the live module: no checkpoint needs to be loaded again to use what a run trained.
"""

from __future__ import annotations

import copy
import os
from typing import Literal, Optional

import lightning as L
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info

from r3lightning.callbacks.monitor import log_dir_of
from r3lightning.checkpointing.export import check_export, check_writable_directory, export_policy


class HuggingFaceExport(L.Callback):
    """Writes the policy as a Hugging Face model directory (config, safetensors, tokenizer with its chat
    template, generation config) at the end of ``fit`` and, optionally, every N optimizer steps.

    Directories: ``<dirpath>/final`` at the end of fit and ``<dirpath>/step<S>`` every
    ``every_n_train_steps`` steps; an existing directory of the same name is not overwritten (an error
    names it). ``AutoModelForCausalLM.from_pretrained`` and vLLM load them as they are. Each export is
    written to a temporary directory beside its target and renamed when complete (a full disk leaves
    nothing half-written; the error names the callback and the directory), and the directory of the
    exports is checked for writing at set-up.

    Args:
        dirpath: where the exports go; null: ``<log_dir>/hf_export`` (next to the TensorBoard logs).
        every_n_train_steps: also export after every N optimizer steps; null or 0: only at the end.
        lora: LoRA policies: ``merged`` folds the adapters into the weights (a plain model), ``adapter``
            writes the PEFT adapter for the base model at ``model.model.name_or_path``.
        at_fit_end: export when ``fit`` ends (also when it ends early, e.g. stopped by the health
            watchdog: the export holds the weights the run ended with).
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        every_n_train_steps: Optional[int] = None,
        lora: Literal["merged", "adapter"] = "merged",
        at_fit_end: bool = True,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(f"HuggingFaceExport: every_n_train_steps must be >= 0, got {every_n_train_steps}")
        if lora not in ("merged", "adapter"):
            raise ValueError(f"HuggingFaceExport: lora must be 'merged' or 'adapter', got {lora!r}")
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps or 0
        self.lora = lora
        self.at_fit_end = at_fit_end
        self.exported: list[str] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError(
                "HuggingFaceExport: an FSDP-sharded policy cannot be exported from the live module; save a "
                "checkpoint, consolidate it and run r3l export"
            )
        check_export(pl_module.model_config, self.lora, "HuggingFaceExport: model.model")
        if trainer.is_global_zero:
            check_writable_directory(self._root(trainer), "HuggingFaceExport: dirpath")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self.every_n_train_steps and step > 0 and step % self.every_n_train_steps == 0:
            self._export(trainer, pl_module, f"step{step}")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at_fit_end:
            self._export(trainer, pl_module, "final")

    def _root(self, trainer: L.Trainer) -> str:
        return self.dirpath or os.path.join(log_dir_of(trainer), "hf_export")

    def _export(self, trainer: L.Trainer, pl_module: L.LightningModule, name: str) -> None:
        if not trainer.is_global_zero:
            return
        out_dir = os.path.join(self._root(trainer), name)
        # A copy on the CPU: merging LoRA and setting the generation ids change the model they act on,
        # and the run's own policy goes on training.
        policy = copy.deepcopy(pl_module.policy).cpu().eval()
        export_policy(policy, pl_module.tokenizer, pl_module.model_config, out_dir, self.lora, who="HuggingFaceExport")
        self.exported.append(out_dir)
        rank_zero_info(f"[r3lightning] exported the policy at step {trainer.global_step} to {out_dir} (Hugging Face format)")
