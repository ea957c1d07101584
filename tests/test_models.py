"""Tiny models, the in-memory tokenizer and model loading errors."""

import pytest
import torch

from r3lightning.training.models import (
    ModelConfig,
    TinyModelSpec,
    apply_lora,
    build_tiny_model,
    build_tokenizer,
    count_parameters,
    load_pretrained,
    tokenizer_fingerprint,
    tokenizer_from_json,
)
from r3lightning.rollout.chat import ChatFormatter

CORPUS = ["Compute 7+12.", "\\boxed{19}", "Your task: put the apple on the desk."] * 5


def test_tokenizer_round_trip_and_chat_template():
    tok = build_tokenizer(CORPUS, vocab_size=300)
    text = "Compute 3+4. Unseen wörds work too!"
    assert tok.decode(tok(text)["input_ids"]) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_tokenizer_is_deterministic_and_serializable():
    a, b = build_tokenizer(CORPUS, 300), build_tokenizer(CORPUS, 300)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    c = tokenizer_from_json(a.backend_tokenizer.to_str())
    assert tokenizer_fingerprint(c) == tokenizer_fingerprint(a)
    assert tokenizer_fingerprint(build_tokenizer(CORPUS + ["something else entirely"], 300)) != tokenizer_fingerprint(a)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_builds_and_runs(arch):
    tok = build_tokenizer(CORPUS, 300)
    model = build_tiny_model(TinyModelSpec(architecture=arch, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_layers=1, intermediate_size=64), tok)
    ids = torch.tensor([tok("Compute 7+12.")["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))
    again = build_tiny_model(TinyModelSpec(architecture=arch, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_layers=1, intermediate_size=64), tok)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_head_dim_below_32_is_rejected():
    tok = build_tokenizer(CORPUS, 300)
    with pytest.raises(ValueError, match="head_dim >= 32"):
        build_tiny_model(TinyModelSpec(hidden_size=64, num_attention_heads=4), tok)


def test_missing_local_model_path_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="model.name_or_path"):
        load_pretrained(ModelConfig(name_or_path="/nonexistent/model"))


def test_lora_trains_only_adapters():
    tok = build_tokenizer(CORPUS, 300)
    model = build_tiny_model(TinyModelSpec(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_layers=1, intermediate_size=64), tok)
    total = count_parameters(model)
    wrapped = apply_lora(model, ModelConfig(lora_rank=4))
    assert 0 < count_parameters(wrapped, trainable_only=True) < total / 5


def test_chat_formatter_rejects_tokenizer_without_template():
    tok = build_tokenizer(CORPUS, 300)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        ChatFormatter(tok)


def test_chat_formatter_increments_match_full_rendering():
    tok = build_tokenizer(CORPUS, 300)
    chat = ChatFormatter(tok, system_prompt="sys")
    first = chat.first_prompt("hello")
    reply = tok("answer", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    second = chat.next_user_turn("again", previous_ended_with_eos=True)
    full = tok.apply_chat_template(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}, {"role": "assistant", "content": "answer"}, {"role": "user", "content": "again"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(first + reply + second) == full
