"""bapo: off-policy RL for LLM math reasoning with BAPO adaptive clipping."""

__version__ = "0.1.0"
