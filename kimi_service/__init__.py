"""kimi-service: plan, run, check and monitor a vLLM endpoint on NVIDIA GPU hosts."""

__version__ = "0.1.0"
