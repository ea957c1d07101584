"""Lightning callbacks for r3lightning runs (name them under ``trainer.callbacks`` in a config)."""

from callbacks.health import HealthWatchdog
from callbacks.monitor import RolloutSampleLogger, TrainingDynamicsMonitor
from callbacks.phase_report import PhaseReport
from callbacks.vllm_sync import VLLMWeightSync

__all__ = ["HealthWatchdog", "PhaseReport", "RolloutSampleLogger", "TrainingDynamicsMonitor", "VLLMWeightSync"]
