"""Chat-template token bookkeeping, done once and incrementally.

A conversation is extended by *appending tokens*: the first prompt is rendered by the tokenizer's
chat template; each later user message is rendered as the exact text the template would insert
after an assistant message, tokenized on its own and appended. Generated tokens are never decoded
and re-encoded, so the sequence the trainer sees is the sequence the engine produced.
"""

from __future__ import annotations

from typing import Optional

_SYSTEM, _USER, _ASSISTANT, _NEXT = "\x00S\x00", "\x00U\x00", "\x00A\x00", "\x00N\x00"


class ChatFormatter:
    """Renders conversation pieces to token ids for one tokenizer.

    The template is probed once with sentinel strings to find (a) what it appends after an
    assistant message's content ("closing", e.g. ``<|im_end|>\\n``) and (b) the text of a following
    user message plus generation prompt. A template that is not prefix-stable (rendering more
    messages changes earlier text, as Qwen3's own does) serves first prompts, so single-turn tasks
    work with any template; a later user message (``next_user_turn``) needs a prefix-stable one, since
    no incremental scheme can be exact without it, and is refused with the key that fixes it
    (``require_prefix_stable``).
    """

    def __init__(self, tokenizer, system_prompt: Optional[str] = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat template; set model.model.chat_template")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.eos_text = tokenizer.eos_token or ""
        head = self._messages(_USER) + [{"role": "assistant", "content": _ASSISTANT}]
        base = self._render(head, generation_prompt=False)
        full = self._render(head + [{"role": "user", "content": _NEXT}], generation_prompt=True)
        # Whether rendering a later message leaves the text of the earlier ones as it was.
        self.prefix_stable = full.startswith(base)
        if self.prefix_stable:
            self.closing = base[base.rindex(_ASSISTANT) + len(_ASSISTANT) :]
            self.next_prefix, self.next_suffix = full[len(base) :].split(_NEXT)

    def require_prefix_stable(self, why: str) -> None:
        """Raise ValueError naming ``model.model.chat_template`` when the template is not prefix-stable;
        ``why`` says what needs more than one user message."""
        if not self.prefix_stable:
            raise ValueError(
                f"the chat template is not prefix-stable (rendering a later message changes the text of earlier "
                f"ones, as Qwen3's own template does with past reasoning) and {why}, which needs one to book its "
                "tokens turn by turn; set model.model.chat_template to a prefix-stable template (qwen3_prefix_stable "
                "for the Qwen3 family, or a file); single-turn tasks work with any template"
            )

    def _messages(self, user: str) -> list[dict]:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": user}]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def first_prompt(self, user_message: str, history: Optional[list[dict]] = None) -> list[int]:
        """Tokens of system + first user message + generation prompt; with ``history`` (a task's chat
        messages before the user message, ``Task.history``), those messages instead of the system prompt."""
        messages = [*history, {"role": "user", "content": user_message}] if history else self._messages(user_message)
        return self.encode(self._render(messages, generation_prompt=True))

    def next_user_turn(self, user_message: str, previous_ended_with_eos: bool) -> list[int]:
        """Tokens to append after an assistant response to add ``user_message`` and a generation prompt.

        When the response stopped on the end-of-turn token, only the rest of the template's closing
        is added; when it was cut off, the whole closing is (the model did not produce it).
        """
        self.require_prefix_stable("this conversation has a second user message")
        closing = self.closing
        if previous_ended_with_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]
        return self.encode(closing + self.next_prefix + user_message + self.next_suffix)
