"""Rollout engines: token ids in, sampled token ids and behaviour log-probs out (``base``), chosen by
``config``; ``hf`` decodes on the live policy module, ``vllm`` runs vLLM fed the policy's weights."""
