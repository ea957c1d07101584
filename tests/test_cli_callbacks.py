"""The callbacks ``r3l`` adds to a config's own (``r3lightning.cli.added_callbacks``): with the vLLM
engine the weight sync comes by itself, as the step checkpoint does, unless the config names one."""

from lightning.pytorch.callbacks import ModelCheckpoint

from r3lightning.callbacks import StepCheckpoint, TrainingDynamicsMonitor, VLLMWeightSync
from r3lightning.cli.main import added_callbacks


def kinds(callbacks):
    return [type(c) for c in callbacks]


def test_the_vllm_engine_gets_its_weight_sync_unless_the_config_names_one():
    assert VLLMWeightSync in kinds(added_callbacks({}, "vllm"))
    assert VLLMWeightSync not in kinds(added_callbacks({}, "hf"))
    own = VLLMWeightSync(every_n_steps=2)
    assert VLLMWeightSync not in kinds(added_callbacks({"callbacks": [own]}, "vllm"))


def test_defaults_step_aside_for_the_config_own_instances():
    added = kinds(added_callbacks({"callbacks": [TrainingDynamicsMonitor(), ModelCheckpoint()]}, "hf"))
    assert TrainingDynamicsMonitor not in added and StepCheckpoint not in added
    assert StepCheckpoint not in kinds(added_callbacks({"enable_checkpointing": False}, "hf"))
    assert StepCheckpoint in kinds(added_callbacks({}, "hf"))
