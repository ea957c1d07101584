"""The ``hf`` engine: decoding on the live policy module (``engine``), its KV caches, the fused and
compiled decoding steps and the sampler."""
