"""``PromptSuite``: your own prompts (JSONL, Parquet, a local Hugging Face dataset; a string or chat
messages) scored by your own functions, called with the completion, the prompt and every column."""

import json
import sys

import pytest

from r3lightning.envs import PromptSuite
from r3lightning.envs.prompt_suite import RewardFunctionError, load_function
from r3lightning.rollout.chat import ChatFormatter

REWARDS = '''
calls = []

def exact(completion, prompt, answer, **row):
    calls.append(dict(completion=completion, prompt=prompt, answer=answer, **row))
    return 1.0 if completion.strip() == answer else 0.0

def short(completion, **row):
    return 0.5 if len(completion) < 5 else 0.0
'''


@pytest.fixture
def task_dir(tmp_path, monkeypatch):
    (tmp_path / "ptask_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # a module rewritten within a second is read again
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("ptask_") or m in BROKEN_MODULES]:
        sys.modules.pop(name)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_string_prompts_and_every_column_reach_the_reward_function(task_dir):
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1), "topic": "add", "level": i} for i in range(6)]
    write_jsonl(task_dir / "tasks.jsonl", rows)
    suite = PromptSuite("jsonl:tasks.jsonl", "ptask_rewards:exact", num_val_tasks=2)
    assert suite.answer_format == "raw" and len(suite.val_tasks()) == 2
    task = suite.train_task(0)
    env = suite.make_env()
    row = next(r for r in rows if r["prompt"] == env.reset(task))
    result = env.step(f" {row['answer']} ")
    assert (result.reward, result.done, result.info["success"]) == (1.0, True, True)
    calls = sys.modules["ptask_rewards"].calls
    assert calls[-1] == {"completion": f" {row['answer']} ", **row}
    env.reset(task)
    assert env.step("no").reward == 0.0
    # The stream covers the training rows once per epoch, validation rows never.
    val = {t.prompt for t in suite.val_tasks()}
    train = {suite.train_task(i).prompt for i in range(4)}
    assert len(train) == 4 and not train & val


def test_several_reward_functions_are_summed_with_their_weights(task_dir):
    write_jsonl(task_dir / "tasks.jsonl", [{"prompt": "Say 7.", "answer": "7"}, {"prompt": "Say 8.", "answer": "8"}])
    suite = PromptSuite("jsonl:tasks.jsonl", ["ptask_rewards:exact", "ptask_rewards:short"], reward_weights=[0.5, 1.0], num_val_tasks=0)
    env = suite.make_env()
    task = suite.train_task(0)
    env.reset(task)
    result = env.step(task.data["row"]["answer"])
    assert result.reward == pytest.approx(0.5 * 1.0 + 1.0 * 0.5)
    assert result.info["rewards"] == {"ptask_rewards:exact": 1.0, "ptask_rewards:short": 0.5}


def test_chat_message_prompts_keep_their_system_message_and_earlier_turns(task_dir, world_tokenizer):
    messages = [
        {"role": "system", "content": "You count."},
        {"role": "user", "content": "Say 1."},
        {"role": "assistant", "content": "1"},
        {"role": "user", "content": "Say 2."},
    ]
    write_jsonl(task_dir / "chat.jsonl", [{"prompt": messages, "answer": "2"}])
    suite = PromptSuite("jsonl:chat.jsonl", "ptask_rewards:exact", num_val_tasks=0, system_prompt="unused")
    task = suite.train_task(0)
    assert task.prompt == "Say 2." and task.history == messages[:3]
    env = suite.make_env()
    env.reset(task)
    env.step("2")
    assert sys.modules["ptask_rewards"].calls[-1]["prompt"] == messages  # the prompt as the row holds it
    chat = ChatFormatter(world_tokenizer, suite.system_prompt)
    rendered = world_tokenizer.decode(chat.first_prompt(task.prompt, task.history))
    expected = world_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == world_tokenizer.decode(world_tokenizer(expected, add_special_tokens=False)["input_ids"])
    assert "unused" not in rendered


def test_parquet_and_a_local_hugging_face_dataset(task_dir):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"Say {i}.", "answer": str(i)} for i in range(4)]
    dataset = datasets.Dataset.from_list(rows)
    dataset.to_parquet(str(task_dir / "tasks.parquet"))
    dataset.save_to_disk(str(task_dir / "saved"))
    for source in ("parquet:tasks.parquet", "hf:saved"):
        suite = PromptSuite(source, "ptask_rewards:exact", num_val_tasks=1)
        assert sorted(t.prompt for t in [*suite.val_tasks(), *(suite.train_task(i) for i in range(3))]) == [r["prompt"] for r in rows]
    with pytest.raises(FileNotFoundError, match="local directories"):
        PromptSuite("hf:openai/gsm8k", "ptask_rewards:exact")


def test_a_reward_function_given_by_file_path(task_dir):
    (task_dir / "elsewhere.py").write_text("def score(completion, **row):\n    return 0.25\n")
    assert load_function(str(task_dir / "elsewhere.py") + ":score")(completion="x") == 0.25


@pytest.mark.parametrize(
    "rows, reward_fn, message",
    [
        ([{"question": "q"}], "ptask_rewards:exact", "row 1 has no 'prompt' column"),
        ([{"prompt": "q", "completion": "a"}], "ptask_rewards:exact", "may not be named 'completion'"),
        ([{"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}], "ptask_rewards:exact", "must be the user's"),
        ([{"prompt": 3}], "ptask_rewards:exact", "expected a string or a list of chat messages"),
        ([{"prompt": "q"}], "ptask_rewards", "not 'package.module:function'"),
        ([{"prompt": "q"}], "no_such_module_r3l:f", "cannot import 'no_such_module_r3l'"),
        ([{"prompt": "q"}], "ptask_rewards:missing", "has no function 'missing'"),
    ],
)
def test_bad_rows_and_reward_names_are_refused_naming_what_to_fix(task_dir, rows, reward_fn, message):
    write_jsonl(task_dir / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        PromptSuite("jsonl:bad.jsonl", reward_fn, num_val_tasks=0)


def test_a_reward_that_is_not_a_number_is_an_error_the_loop_masks(task_dir):
    """A function that passes set-up's check but returns text on some answer: that call raises
    ``RewardFunctionError`` naming the function and the row (the agent loop masks the sample)."""
    (task_dir / "ptask_text.py").write_text("def f(completion, **row):\n    return 'good' if completion else 0.0\n")
    write_jsonl(task_dir / "tasks.jsonl", [{"prompt": "q"}])
    suite = PromptSuite("jsonl:tasks.jsonl", "ptask_text:f", num_val_tasks=0)
    env = suite.make_env()
    env.reset(suite.train_task(0))
    with pytest.raises(RewardFunctionError, match="reward_fn 'ptask_text:f' returned 'good' on row 1 of tasks.jsonl.*finite float"):
        env.step("x")


BROKEN_MODULES = {
    "syntax_err": ("def reward(completion, **row)\n    return 1.0\n", r"SyntaxError: expected ':' \(.*syntax_err.py, line 1\)"),
    "raises_at_import": (
        "import os\n\nif 'REWARD_API_KEY' not in os.environ:\n    raise RuntimeError('config not found: REWARD_API_KEY')\n",
        r"RuntimeError: config not found: REWARD_API_KEY \(.*raises_at_import.py, line 4\)",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN_MODULES))
@pytest.mark.parametrize("by_path", [False, True])
def test_a_reward_module_that_does_not_import_is_one_error_naming_its_file_and_line(task_dir, name, by_path):
    text, message = BROKEN_MODULES[name]
    (task_dir / f"{name}.py").write_text(text)
    write_jsonl(task_dir / "tasks.jsonl", [{"prompt": "q"}])
    spec = f"{task_dir / name}.py:reward" if by_path else f"{name}:reward"
    with pytest.raises(ValueError, match=r"data.suite.init_args.reward_fn: cannot import .*" + message):
        PromptSuite("jsonl:tasks.jsonl", spec, num_val_tasks=0)


SETUP_REFUSALS = {
    "def wrong_signature(text):\n    return 1.0\n": "cannot be called as fn\\(completion=..., prompt=..., \\*\\*row\\) with row 1 of tasks.jsonl.*missing a required argument: 'text'",
    "def reward(completion, answer):\n    return 1.0\n": "cannot be called .*unexpected keyword argument 'prompt'.*def reward\\(completion, \\*\\*row\\)",
    "def reward(completion, **row):\n    return None\n": "returned None on row 1 of tasks.jsonl .*a NoneType, not a number",
    "def reward(completion, **row):\n    return '0.5'\n": "returned '0.5' on row 1.*text, not a number",
    "def reward(completion, **row):\n    return float('nan')\n": "returned nan on row 1.*not finite",
    "def reward(completion, **row):\n    return float('inf')\n": "returned inf on row 1.*not finite",
    "def reward(completion, **row):\n    return completion == row['answer']\n": "returned False on row 1.*a bool; return float\\(False\\)",
    "import torch\ndef reward(completion, **row):\n    return torch.ones(2)\n": "returned tensor.*a Tensor of 2 elements",
}


@pytest.mark.parametrize("source", sorted(SETUP_REFUSALS))
def test_reward_functions_are_checked_at_setup_on_the_first_row(task_dir, source):
    """Signature and return value are checked on a real row before any training: refused with the
    function's name, the row and what to change."""
    (task_dir / "ptask_setup.py").write_text(source)
    write_jsonl(task_dir / "tasks.jsonl", [{"prompt": "q", "answer": "7"}, {"prompt": "r", "answer": "8"}])
    with pytest.raises(ValueError, match="data.suite.init_args.reward_fn 'ptask_setup:[a-z_]+' " + SETUP_REFUSALS[source]):
        name = source.split("def ")[1].split("(")[0]
        PromptSuite("jsonl:tasks.jsonl", f"ptask_setup:{name}", num_val_tasks=0)


@pytest.mark.parametrize("source", [
    "import torch\ndef reward(completion, **row):\n    return torch.tensor(0.5)\n",
    "import numpy\ndef reward(completion, **row):\n    return numpy.float32(0.5)\n",
    "def reward(completion, **row):\n    return 1 // 2 + 0.5\n",
])
def test_a_reward_that_converts_cleanly_to_a_number_is_taken(task_dir, source):
    (task_dir / "ptask_convert.py").write_text(source)
    write_jsonl(task_dir / "tasks.jsonl", [{"prompt": "q"}])
    suite = PromptSuite("jsonl:tasks.jsonl", "ptask_convert:reward", num_val_tasks=0)
    env = suite.make_env()
    env.reset(suite.train_task(0))
    assert env.step("x").reward == 0.5


def test_a_function_that_raises_passes_setup_and_each_failing_call_names_it_the_row_and_the_error(task_dir):
    """An empty answer may fairly fail, so set-up's call does not judge an exception; the run does."""
    (task_dir / "ptask_raises.py").write_text("def reward(completion, **row):\n    raise KeyError('score')\n")
    write_jsonl(task_dir / "tasks.jsonl", [{"prompt": "q"}, {"prompt": "r"}])
    suite = PromptSuite("jsonl:tasks.jsonl", "ptask_raises:reward", num_val_tasks=0)
    assert "reward_fn 'ptask_raises:reward'" in suite.describe()
    env = suite.make_env()
    task = suite.train_task(0)
    env.reset(task)
    with pytest.raises(RewardFunctionError, match=rf"reward_fn 'ptask_raises:reward' raised KeyError: 'score' on row \d of tasks.jsonl \(task '{task.task_id}'\)"):
        env.step("x")
