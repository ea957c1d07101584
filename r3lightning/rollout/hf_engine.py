"""The ``hf`` engine: ``generate`` on the live policy module (no weight sync needed)."""

from __future__ import annotations

import torch

from r3lightning.rollout.engine import Generation, SamplingParams, truncate_at_stop


class HFEngine:
    """Batched sampling with Hugging Face ``generate`` on the very module being trained.

    Because it shares the trainer's parameters, every rollout sees the latest optimizer step;
    ``weight_version`` is advanced by the module after each step for bookkeeping only.
    max_batch_size: prompts per ``generate`` call (bounds activation memory).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, max_batch_size: int = 64) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self.stop_token_ids = {tokenizer.eos_token_id}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        results: list[Generation] = []
        for start in range(0, len(prompts), self.max_batch_size):
            results.extend(self._generate_chunk(prompts[start : start + self.max_batch_size], params))
        return results

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        # Left padding so every prompt ends at the same position and decoding appends in lockstep.
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                do_sample=not params.greedy,
                temperature=params.temperature if not params.greedy else None,
                top_p=params.top_p if not params.greedy else None,
                top_k=None,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=sorted(self.stop_token_ids),
                pad_token_id=pad,
                stop_strings=params.stop or None,
                tokenizer=self.tokenizer if params.stop else None,
                return_dict_in_generate=True,
                output_logits=True,
            )
        finally:
            self.model.train(was_training)
        new_tokens = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()
        scale = params.temperature if not params.greedy else 1.0
        logprobs = torch.log_softmax(logits / scale, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        budget_hit = new_tokens.shape[1] >= params.max_new_tokens
        return [
            truncate_at_stop(
                new_tokens[row].tolist(),
                logprobs[row].tolist(),
                self.stop_token_ids,
                params.stop,
                self.tokenizer.decode,
                budget_exhausted=budget_hit,
            )
            for row in range(len(prompts))
        ]
