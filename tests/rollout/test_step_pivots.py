"""R³L step-level pivots for single-turn reasoning: the step splitter, step turns under the pivotal
mask, and an end-to-end retry that continues a math answer from its first k steps."""

import dataclasses
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from r3lightning.data.collate import collate_experience
from r3lightning.rollout.explorers.base import ExplorationSpec
from r3lightning.envs.math_env import MathSuite
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest
from r3lightning.engines.base import Generation, SamplingParams
from r3lightning.rollout.metrics import trajectory_metrics
from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer
from r3lightning.rollout.steps import split_final_turn, split_steps, step_lengths
from r3lightning.types import Group, Trajectory, Turn


@pytest.mark.parametrize(
    "pieces, lengths",
    [
        (["a", "\n", "b", "\n"], [2, 2]),  # one step per line
        (["a\n", "\n", " \n", "b"], [3, 1]),  # blank lines join the step before them
        (["\n", "a\n", "b"], [2, 1]),  # a leading blank line joins the first step
        (["a", "\nb", "c\n", "d"], [3, 1]),  # a newline inside a token does not cut
        (["a\n", "b", ""], [1, 2]),  # the end-of-turn token (decoded as "") joins the last step
        (["a\n", "  "], [2]),  # trailing whitespace without a newline is a blank line too
        (["  \n", "\n"], [2]),  # no non-blank line: one step
        ([], [0]),  # empty response: one empty step
    ],
)
def test_step_lengths_rule(pieces, lengths):
    assert step_lengths(pieces) == lengths


# Reasoning-like fragments (lines, blank lines, indentation, multi-byte characters) and arbitrary text.
fragments = st.sampled_from(["Let", " x", " = 1", ".", "\n", "\n\n", "  ", "\t", " \n", "\\boxed{3}", "é", "中文", "}"])
response_text = st.lists(fragments | st.text(max_size=4), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(response_text, st.booleans())
@example("\x85\nLet", False)  # a blank line whose character spans two byte tokens (found by hypothesis in CI)
def test_split_steps_round_trips(world_tokenizer, text, with_eos):
    ids = world_tokenizer(text, add_special_tokens=False)["input_ids"] + ([world_tokenizer.eos_token_id] if with_eos else [])
    steps = split_steps(ids, world_tokenizer)
    assert [tok for step in steps for tok in step] == ids  # exact tokens, in order
    texts = [world_tokenizer.decode(step, skip_special_tokens=True) for step in steps]
    assert "".join(texts) == world_tokenizer.decode(ids, skip_special_tokens=True)
    assert all(t.endswith("\n") for t in texts[:-1])  # steps end at line ends
    if len(steps) > 1:
        assert all(t.strip() for t in texts)  # and none is blank
    assert len(steps) <= max(1, sum(1 for line in text.split("\n") if line.strip()))


def _step_level(tokenizer, context, response, logprob=-0.5):
    ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    turn = Turn(context_ids=context, response_ids=ids, logprobs=[logprob] * len(ids), action=response, feedback="Correct.")
    return split_final_turn(Trajectory("t", [turn], reward=1.0, success=True), tokenizer)


def test_step_turns_keep_tokens_logprobs_and_messages(world_tokenizer):
    original_ids = world_tokenizer("a = 1\nb = 2\n\nc = 3", add_special_tokens=False)["input_ids"]
    traj = _step_level(world_tokenizer, [7, 8, 9], "a = 1\nb = 2\n\nc = 3")
    assert [world_tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in traj.turns] == [
        "a = 1\n",
        "b = 2\n\n",
        "c = 3",
    ]
    assert traj.token_ids() == [7, 8, 9] + original_ids + [world_tokenizer.eos_token_id]
    assert [t.context_ids for t in traj.turns] == [[7, 8, 9], [], []]
    assert all(t.logprobs == [-0.5] * len(t.response_ids) for t in traj.turns)
    assert [t.feedback for t in traj.turns] == ["", "", "Correct."]  # the message's outcome sits on its last step
    assert traj.num_messages == 1
    metrics = trajectory_metrics([Group("t", [traj])])
    assert metrics["rollout/num_turns"] == 1.0


def test_pivotal_mask_on_step_turns(world_tokenizer):
    traj = _step_level(world_tokenizer, [7, 8, 9], "one\ntwo\nthree\nfour")
    step_tokens = [len(t.response_ids) for t in traj.turns]
    plain = collate_experience([traj], [1.0], world_tokenizer.pad_token_id, pivotal_credit=True)
    n = len(traj.token_ids())
    assert plain.loss_mask[0, :n].int().tolist() == [0] * 3 + [1] * sum(step_tokens)  # assistant tokens only
    pivoted = dataclasses.replace(traj, pivot=2)
    batch = collate_experience([pivoted], [1.0], world_tokenizer.pad_token_id, pivotal_credit=True)
    assert batch.loss_mask[0, :n].int().tolist() == [0] * (3 + sum(step_tokens[:2])) + [1] * sum(step_tokens[2:])
    assert batch.turn_index[0, 3 : 3 + step_tokens[0]].tolist() == [0] * step_tokens[0]


class ScriptedMathEngine:
    """Base answers, reflections and guided continuations chosen by what the prompt contains."""

    def __init__(self, tokenizer, base, reflection, continuation):
        self.tokenizer, self.weight_version = tokenizer, 0
        self.replies = {"base": base, "reflection": reflection, "continuation": continuation}
        self.prompts = {"base": [], "reflection": [], "continuation": []}

    def ids(self, kind):
        return self.tokenizer(self.replies[kind], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            kind = "reflection" if "Review this attempt" in text else "continuation" if "GUIDANCE-MARKER" in text else "base"
            self.prompts[kind].append(prompt)
            ids = self.ids(kind)
            out.append(Generation(ids, [-0.25 if kind == "base" else -0.75] * len(ids), "stop"))
        return out


def _math_loop(world_tokenizer, engine):
    suite = MathSuite(source="arithmetic", max_attempts=1, num_val_tasks=2, instruction="")
    return suite, AgentLoop(suite, engine, world_tokenizer, AgentLoopConfig(action_format="raw", max_context_tokens=1024))


def test_step_level_retry_continues_from_the_first_k_steps(world_tokenizer):
    task = MathSuite(source="arithmetic", num_val_tasks=2, instruction="").train_task(0)
    answer = int(task.answer)
    reflection = {
        "trajectory_summary": "s",
        "root_cause_analysis": "wrong sum",
        "trajectory_outcome": "failure",
        "improvement_suggestion": "GUIDANCE-MARKER",
        "retry_from_step": 2,
    }
    # The answer tag opens in the kept steps and closes in the continuation: only the whole
    # message (steps + continuation) holds an answer, so a correct grade proves the full text is graded.
    engine = ScriptedMathEngine(
        world_tokenizer,
        base=f"Let me add.\n<answer>\n{answer + 1}\n</answer>",
        reflection=json.dumps(reflection),
        continuation=f"{answer}\n</answer>",
    )
    _, loop = _math_loop(world_tokenizer, engine)
    explorer = ReflectRetryExplorer()
    out = explorer.explore([task], loop, ExplorationSpec(2, SamplingParams()))

    base, distilled = out.groups[0].trajectories
    assert (base.origin, distilled.origin) == ("base", "distilled")
    steps = [world_tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in base.turns]
    assert steps == ["Let me add.\n", "<answer>\n", f"{answer + 1}\n", "</answer>"]
    assert base.reward == 0.0 and distilled.reward == 1.0 and distilled.success

    # The reflection saw the steps numbered.
    reflection_text = world_tokenizer.decode(engine.prompts["reflection"][0])
    assert "Step 0: Let me add." in reflection_text and "Step 3: </answer>" in reflection_text

    # One engine call for the retry: guided question, then the first k steps verbatim as the start of the answer.
    kept = [tok for t in base.turns[:2] for tok in t.response_ids]
    guided = loop.config.guidance_template.format(observation=task.prompt, guidance=explorer.reflector.guidance(reflection))
    assert engine.prompts["continuation"] == [loop.chat.first_prompt(guided) + kept]

    # Distilled = original context (no guidance) + first k steps + continuation, both pivoted at k.
    continuation = engine.ids("continuation")
    assert distilled.token_ids() == base.turns[0].context_ids + kept + continuation
    assert "GUIDANCE" not in world_tokenizer.decode(distilled.token_ids())
    assert base.pivot == distilled.pivot == 2
    for b, d in zip(base.turns[:2], distilled.turns[:2]):
        assert d.response_ids == b.response_ids and d.logprobs == b.logprobs  # the base's behaviour log-probs

    # Pivotal credit: the first k steps' tokens are masked in both; what follows is trained.
    batch = collate_experience([base, distilled], [1.0, 1.0], world_tokenizer.pad_token_id, pivotal_credit=True)
    prompt_len = len(base.turns[0].context_ids)
    for row, traj in enumerate([base, distilled]):
        trained = batch.input_ids[row][batch.loss_mask[row].bool()].tolist()
        assert trained == traj.token_ids()[prompt_len + len(kept) :]
    assert batch.input_ids[1][batch.loss_mask[1].bool()].tolist() == continuation

    assert out.metrics["rollout/pivot_position"] == 0.5  # step 2 of 4
    assert out.metrics["rollout/retry_tokens_saved"] == len(kept)
    assert out.metrics["rollout/retry_improvement_rate"] == 1.0

    # Meta-tasks: the retry sample trains the continuation under the guidance, the kept steps are context.
    retry_sample = next(t for t in out.sft if t.origin == "retry_sft")
    sft = collate_experience([retry_sample], [0.0], world_tokenizer.pad_token_id)
    assert sft.input_ids[0][sft.sft_mask[0].bool()].tolist() == continuation
    assert "GUIDANCE-MARKER" in world_tokenizer.decode(retry_sample.token_ids())


def test_step_split_off_retries_single_turn_from_scratch(world_tokenizer):
    reflection = {
        "trajectory_summary": "s",
        "root_cause_analysis": "r",
        "trajectory_outcome": "failure",
        "improvement_suggestion": "GUIDANCE-MARKER",
        "retry_from_step": 0,
    }
    task = MathSuite(source="arithmetic", num_val_tasks=2, instruction="").train_task(0)
    base_text, retry_text = "one\ntwo\n\\boxed{-1}", f"\\boxed{{{task.answer}}}"
    engine = ScriptedMathEngine(world_tokenizer, base=base_text, reflection=json.dumps(reflection), continuation=retry_text)
    _, loop = _math_loop(world_tokenizer, engine)
    explorer = ReflectRetryExplorer(step_split="off")
    out = explorer.explore([task], loop, ExplorationSpec(2, SamplingParams()))
    base, distilled = out.groups[0].trajectories
    assert len(base.turns) == 1 and len(distilled.turns) == 1  # whole messages, no steps
    assert "Step 1:" not in world_tokenizer.decode(engine.prompts["reflection"][0])
    guided = loop.config.guidance_template.format(observation=task.prompt, guidance=explorer.reflector.guidance(reflection))
    assert engine.prompts["continuation"] == [loop.chat.first_prompt(guided)]  # from scratch
    assert distilled.success and distilled.pivot == 0 and base.pivot is None


def test_response_prefix_is_continued_and_counts_toward_the_context_limit(world_tokenizer):
    task = MathSuite(source="arithmetic", num_val_tasks=2, instruction="").train_task(0)
    engine = ScriptedMathEngine(world_tokenizer, base="", reflection="", continuation="")
    _, loop = _math_loop(world_tokenizer, engine)
    prompt = loop.chat.first_prompt(task.prompt)
    steps = _step_level(world_tokenizer, prompt, "First.\nSecond.\nThird").turns[:2]
    kept = [tok for t in steps for tok in t.response_ids]
    ending = world_tokenizer(f"\\boxed{{{task.answer}}}", add_special_tokens=False)["input_ids"]
    traj = loop.run_scripted([EpisodeRequest(task=task, response_prefix=steps)], [[ending]])[0]
    assert traj.token_ids() == prompt + kept + ending and traj.num_messages == 1
    assert [t.response_ids for t in traj.turns] == [steps[0].response_ids, steps[1].response_ids, ending]
    assert traj.success and traj.turns[-1].action.startswith("First.\nSecond.\n")  # graded on the whole message
    loop.config.max_context_tokens = len(prompt) + len(kept)
    cut = loop.run_scripted([EpisodeRequest(task=task, response_prefix=steps)], [[ending]])[0]
    assert cut.turns == [] and cut.end_reason == "context_limit"
