"""A rollout engine that answers from a script, for deterministic explorer tests, the callback that
puts it in a training run, and pieces of scripts (importable because pytest's ``pythonpath`` includes
``tests/``)."""

import re

import lightning as L
from harness import ARITHMETIC, suite_tokenizer

from r3lightning.envs.math_env import MathSuite
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig
from r3lightning.engines.base import Generation


class ScriptedEngine:
    """Answers each prompt with ``reply(decoded prompt)``; every token gets log-prob -0.5."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply = tokenizer, reply
        self.weight_version = 0
        self.prompts = []

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            self.prompts.append(self.tokenizer.decode(prompt))
            ids = self.tokenizer(self.reply(self.prompts[-1]), add_special_tokens=False)["input_ids"]
            ids = ids + [self.tokenizer.eos_token_id]
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out


class UseEngine(L.Callback):
    """Swaps the module's rollout engine for a ``ScriptedEngine`` answering with
    ``make_reply(datamodule.suite)`` once the model and tokenizer exist."""

    def __init__(self, make_reply):
        self.make_reply = make_reply

    def on_train_start(self, trainer, module):
        module.use_engine(ScriptedEngine(module.tokenizer, self.make_reply(trainer.datamodule.suite)))


# ---- scripted replies --------------------------------------------------------------------------------
LOOK = "<action>look</action>"


def world_player(suite, tasks, answers, solved_on_base=(), look_first=()):
    """Replies for the procedural world's ``tasks``: reflection and critique prompts get the next of
    ``answers`` (the last one repeats); an episode under guidance follows the expert plan, unless its
    guidance says FAIL (it looks) or names a marker in ``look_first`` (it looks once first); base
    episodes of the ``solved_on_base`` tasks follow the plan; everything else looks."""
    plans = {t.prompt.split("\n")[0]: suite.demonstration(t) for t in tasks}
    solved = {tasks[i].prompt.split("\n")[0] for i in solved_on_base}
    queue = list(answers)

    def reply(text):
        if "Review this attempt" in text or "Critique this attempt" in text:
            return queue.pop(0) if len(queue) > 1 else queue[0]
        goal = next(g for g in plans if g in text)
        guided = "[Guidance" in text
        if (guided and "FAIL" in text) or (not guided and goal not in solved):
            return LOOK
        looked = text.count(LOOK) > 1  # the system prompt shows it once as an example
        if any(marker in text for marker in look_first) and not looked:
            return LOOK
        return expert_action(plans[goal], text)

    return reply


def expert_action(plan, text):
    """The plan's next action, tagged, counting the plan actions already taken in the conversation
    ``text`` (the last one once all are)."""
    step = sum(1 for a in plan if f"<action>{a}</action>" in text)
    return f"<action>{plan[min(step, len(plan) - 1)]}</action>"


def scripted_arithmetic(meta_answer):
    """Single-turn arithmetic (``harness.ARITHMETIC``, raw answers) played by a ``ScriptedEngine``:
    reflection and critique prompts get ``meta_answer``; a question gets the right answer when its
    prompt shows guidance (a retry, a refinement), one too many otherwise. Returns (suite, loop)."""
    suite, agent = MathSuite(**ARITHMETIC), AgentLoopConfig(action_format="raw")
    tokenizer = suite_tokenizer(suite, num_tasks=16, agent=agent)

    def reply(text):
        if "Review this attempt" in text or "Critique this attempt" in text:
            return meta_answer
        a, op, b = re.search(r"Compute (\d+)([+-])(\d+)", text).groups()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        return f"\\boxed{{{right if '[Guidance' in text else right + 1}}}"

    return suite, AgentLoop(suite, ScriptedEngine(tokenizer, reply), tokenizer, agent)
