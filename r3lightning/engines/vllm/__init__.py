"""The ``vllm`` engine (``engine``) and the policy's weights as vLLM loads them (``weights``)."""
