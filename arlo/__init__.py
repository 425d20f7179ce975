"""arlo: high-throughput RL for LLM agents (shared library)."""
