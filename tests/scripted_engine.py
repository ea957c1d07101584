"""A rollout engine that answers from a script, for deterministic explorer tests (importable because
pytest's ``pythonpath`` includes ``tests/``)."""

from r3lightning.rollout.engine import Generation


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
