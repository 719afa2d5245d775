"""Helpers shared by engine, host and role tests: the CPU vLLM venv and the tiny test model."""
