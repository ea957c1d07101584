"""Lightning callbacks for r3lightning runs (name them under ``trainer.callbacks`` in a config).

ReflectRL's reflective-to-direct distillation is no callback: it is the phase ``model.phases.distill``
(``r3lightning.training.phases.DistillPhase``)."""

from r3lightning.callbacks.checkpointing import StepCheckpoint
from r3lightning.callbacks.component_health import ComponentHealth, HealthRefusal, InertComponentError, UpdateSizeError
from r3lightning.callbacks.health import HealthWatchdog
from r3lightning.callbacks.hf_export import HuggingFaceExport
from r3lightning.callbacks.monitor import RolloutSampleLogger, TrainingDynamicsMonitor
from r3lightning.callbacks.phase_report import PhaseReport
from r3lightning.callbacks.vllm_sync import VLLMWeightSync

__all__ = [
    "ComponentHealth",
    "HealthWatchdog",
    "HuggingFaceExport",
    "HealthRefusal",
    "InertComponentError",
    "UpdateSizeError",
    "PhaseReport",
    "RolloutSampleLogger",
    "StepCheckpoint",
    "TrainingDynamicsMonitor",
    "VLLMWeightSync",
]
