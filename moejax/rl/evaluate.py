"""Pass rates on held-out tasks: rl.eval.tasks of each kind of rl.tasks, the same tasks at every
evaluation, each played once at the rollout temperature (a fixed seed) and once greedily. They are drawn
from a random stream of their own; a training task may equal one by chance (not checked: for the
arithmetic of 2- and 3-digit numbers the tasks number in the millions)."""

import numpy as np

from moejax.rl import demonstrations as demos
from moejax.rl.rollout import new_episode, play
from moejax.rl.update import episode_metrics


def eval_tasks(rl_cfg) -> list:
  tasks = []
  for i, kind in enumerate(rl_cfg.tasks):
    rng = np.random.default_rng([rl_cfg.seed, 6, i])
    one = rl_cfg.copy_and_resolve_references()
    one.tasks = (kind,)
    tasks += [demos.draw_task(one, rng) for _ in range(int(rl_cfg.eval.tasks))]
  return tasks


def evaluate(trainer, seed: int) -> dict:
  """eval/... metrics of the held-out tasks (`moejax.rl.update.episode_metrics`), sampled and greedy."""
  rl = trainer.rl
  out = {}
  for prefix, temperature in (("eval/", float(rl.grpo.temperature)), ("eval_greedy/", 0.0)):
    episodes = [new_episode(task, i, trainer.lm.tokenizer, trainer.make_env())
                for i, task in enumerate(eval_tasks(rl))]
    play(trainer.lm, episodes, trainer.make_env, version=-3, seed=seed + 7, temperature=temperature,
         max_turn_tokens=int(rl.max_turn_tokens), episode_tokens=int(rl.episode_tokens))
    out.update(episode_metrics(episodes, prefix))
  return out
