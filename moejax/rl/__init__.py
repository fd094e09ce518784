"""Agentic RL post-training: GRPO/DAPO losses, tool environments, multi-turn rollouts, and the loop
that `python -m moejax.rl` runs (docs/rl.md)."""

from moejax.rl.advantages import group_advantages
from moejax.rl.grpo import grpo_loss

__all__ = ["grpo_loss", "group_advantages"]
