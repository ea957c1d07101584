"""CUDA paths: the hf engine and its prefix cache on the GPU, and a whole SFT -> RL fit with
``accelerator="gpu"`` in fp32 and bf16-mixed precision. Skipped without a CUDA device (CI has none);
run with ``pytest -m gpu tests/gpu``."""

import lightning as L
import pytest
import torch
from harness import TINY_SPEC, quiet_trainer, weights_changed

from r3lightning.algos import selective_log_softmax
from r3lightning.data.datamodule import RolloutDataModule
from r3lightning.data.demonstrations import DemoConfig
from r3lightning.envs.textworld_procedural import ProceduralWorldSuite
from r3lightning.training.models import ModelConfig
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.training.optim import OptimConfig
from r3lightning.training.phases import PhaseSchedule, WarmStartPhase
from r3lightning.module import R3LightningModule
from r3lightning.rollout.agent_loop import AgentLoopConfig
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _conversations(tokenizer):
    chat = ChatFormatter(tokenizer)
    return [chat.first_prompt(t) for t in ("Your task: put the apple on the desk.", "Valid actions: look", "take mug")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_cached_engine_on_cuda_matches_a_fresh_forward_pass(world_tokenizer, world_policy, dtype):
    policy = world_policy.to("cuda", dtype)
    engine = HFEngine(policy, world_tokenizer)
    chat = ChatFormatter(world_tokenizer)
    params = SamplingParams(temperature=0.8, max_new_tokens=6)
    torch.manual_seed(0)
    prompts = _conversations(world_tokenizer)
    for turn in range(3):
        gens = engine.generate(prompts, params)
        for prompt, gen in zip(prompts, gens):
            ids = torch.tensor([prompt + gen.token_ids], device="cuda")
            with torch.no_grad():
                logits = policy(input_ids=ids).logits[:, :-1].float() / 0.8
            fresh = selective_log_softmax(logits, ids[:, 1:])[0, len(prompt) - 1 :].cpu()
            # bf16 rounds the cached keys/values differently from a full pass: looser there.
            tolerance = 1e-4 if dtype == torch.float32 else 0.1
            torch.testing.assert_close(torch.tensor(gen.logprobs), fresh, atol=tolerance, rtol=0)
        ended = [g.token_ids[-1:] == [world_tokenizer.eos_token_id] for g in gens]
        prompts = [p + g.token_ids + chat.next_user_turn("look", e) for p, g, e in zip(prompts, gens, ended)]
    assert engine.cache_hit_rate() > 0.5


def _module_and_data():
    suite = ProceduralWorldSuite(difficulty=1, num_val_tasks=4, max_turns=3, goal_reminder=True)
    data = RolloutDataModule(
        suite,
        group_size=4,
        tasks_per_step=2,
        val_tasks_per_batch=4,
        sampling=SamplingParams(max_new_tokens=12),
        agent=AgentLoopConfig(action_format="tag", max_context_tokens=512),
        explorer=ReflectRetryExplorer(max_reflection_tokens=48),
    )
    module = R3LightningModule(
        model=ModelConfig(tiny=TINY_SPEC),
        algorithm=AlgorithmConfig(policy_loss="pg", positive_amplification=True, pivotal_credit=True, sft_weight=0.1),
        optim=OptimConfig(lr=1e-3, micro_batch_size=8),
        phases=PhaseSchedule(WarmStartPhase(steps=2, demos=DemoConfig(reflections=True, tasks_per_step=4, reflection_tasks_per_step=2))),
    )
    return module, data


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_sft_then_r3l_fit_on_gpu(precision):
    module, data = _module_and_data()
    devices, origins = [], set()

    class DeviceSpy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            devices.append(next(pl_module.policy.parameters()).device.type)
            origins.update(t.origin for t in outputs["trajectories"])

    trainer = quiet_trainer(
        4, accelerator="gpu", devices=1, precision=precision, limit_val_batches=1, val_check_interval=4,
        check_val_every_n_epoch=None, callbacks=[DeviceSpy()],
    )
    trainer.fit(module, data)
    assert devices == ["cuda"] * 4  # Lightning moves the module back to the CPU when fit ends
    assert all(weights_changed(module))
    assert module.skipped_steps == 0
    metrics = trainer.callback_metrics
    for tag in ("train/loss_rl", "train/grad_norm", "rollout/reflection_invalid_rate", "val/success_rate_greedy"):
        assert tag in metrics and torch.isfinite(metrics[tag]), tag
    assert origins >= {"base"}
