"""What an iteration trains on: complete groups of finished episodes, their advantages, and the
rollout's figures.

`collect` plays rounds of episodes: the paused ones first (those drawn by a policy more than
rl.grpo.max_staleness versions old are dropped with their groups), then new groups up to
rl.grpo.groups. A group enters the batch once all its episodes are done; under dynamic sampling a
group whose rewards are all equal is dropped and another round of new groups refills the batch, up
to rl.grpo.refill_rounds times. With a rollout token budget, the groups still running when it is
spent are paused to the next iteration.
"""

import dataclasses
import functools
from collections import defaultdict

import numpy as np

from moejax.inference.conversation import Conversation
from moejax.rl import demonstrations as demos
from moejax.rl.advantages import group_advantages, informative_groups, overlong_penalty
from moejax.rl.rollout import Episode, new_episode, play


def _seed(*parts) -> int:
  return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def shaped_rewards(episodes, rl_cfg) -> np.ndarray:
  """The task rewards plus, with rl.grpo.overlong_cache, DAPO's overlong penalty on the transcript length."""
  r = np.asarray([e.reward for e in episodes], np.float64)
  if rl_cfg.grpo.overlong_cache:
    r = r + overlong_penalty([len(e.transcript) for e in episodes], max_length=int(rl_cfg.episode_tokens),
                             cache=int(rl_cfg.grpo.overlong_cache))
  return r


@dataclasses.dataclass
class Collected:
  kept: list  # episodes of the complete groups that enter the update, advantages set
  finished: list  # every episode that finished this iteration (kept or not)
  paused: list  # episodes to resume next iteration
  next_group: int
  metrics: dict


def collect(trainer, paused: list[Episode], next_group: int, iteration: int) -> Collected:
  rl, g = trainer.rl, trainer.g
  size = int(g.group_size)
  stale = {e.group for e in paused
           if e.transcript.oldest_version() is not None
           and iteration - e.transcript.oldest_version() > int(g.max_staleness)}
  pending = [e for e in paused if e.group not in stale]
  m = defaultdict(float)
  m["episodes_stale"] = float(sum(e.group in stale for e in paused))
  m["episodes_resumed"] = float(sum(not e.done for e in pending))
  kept, finished = [], []
  spent = 0
  rounds = 1 + (int(g.refill_rounds) if g.dynamic_sampling else 0)
  for r in range(rounds):
    in_flight = len({e.group for e in pending})
    rng = np.random.default_rng([rl.seed, 4, iteration, r])
    for _ in range(max(0, int(g.groups) - len(kept) // size - in_flight)):
      task = demos.draw_task(rl, rng)
      pending += [new_episode(task, next_group, trainer.lm.tokenizer, trainer.make_env())
                  for _ in range(size)]
      next_group += 1
    budget = int(g.rollout_tokens)
    if not pending or (budget and spent >= budget):
      break
    stats = play(trainer.lm, pending, trainer.make_env, version=iteration,
                 seed=_seed(rl.seed, 5, iteration, r), temperature=float(g.temperature),
                 max_turn_tokens=int(rl.max_turn_tokens), episode_tokens=int(rl.episode_tokens),
                 token_budget=budget - spent if budget else 0,
                 conversation=functools.partial(Conversation, record_routing=bool(g.routing_replay)))
    spent += stats.sampled_tokens
    m["rollout_sampled_tokens"] += stats.sampled_tokens
    m["rollout_fed_tokens"] += stats.fed_tokens
    m["rollout_seconds"] += stats.seconds
    groups = defaultdict(list)
    for e in pending:
      groups[e.group].append(e)
    complete = [k for k, eps in groups.items() if all(e.done for e in eps)]
    pending = [e for e in pending if e.group not in complete]
    if complete:
      rewards = np.stack([shaped_rewards(groups[k], rl) for k in complete])
      advantages = np.asarray(group_advantages(rewards, scale=g.advantage_scale))
      keep = informative_groups(rewards) if g.dynamic_sampling else np.ones(len(complete), bool)
      for i, k in enumerate(complete):
        finished += groups[k]
        if keep[i]:
          for e, a in zip(groups[k], advantages[i], strict=True):
            e.advantage = float(a)
          kept += groups[k]
      m["groups_kept"] += float(keep.sum())
      m["groups_dropped_flat"] += float((~keep).sum())
    if len(kept) >= int(g.groups) * size or not g.dynamic_sampling:
      break
  m["episodes_paused"] = float(len(pending))
  if m["rollout_seconds"]:
    m["rollout_tokens_per_s"] = m["rollout_sampled_tokens"] / m["rollout_seconds"]
  return Collected(kept, finished, pending, next_group, dict(m))


def episode_metrics(episodes, prefix: str = "") -> dict:
  """Reward mean and max, pass rate per task kind, response length, tool calls and errors per episode."""
  if not episodes:
    return {}
  out = {f"{prefix}reward_mean": float(np.mean([e.reward for e in episodes])),
         f"{prefix}reward_max": float(np.max([e.reward for e in episodes])),
         f"{prefix}response_tokens": float(np.mean([e.transcript.policy_tokens for e in episodes])),
         f"{prefix}tool_calls": float(np.mean([e.tool_calls for e in episodes])),
         f"{prefix}tool_errors": float(np.mean([e.tool_errors for e in episodes])),
         f"{prefix}truncated": float(np.mean([e.truncated for e in episodes]))}
  for kind in sorted({e.task.kind for e in episodes}):
    of_kind = [e for e in episodes if e.task.kind == kind]
    out[f"{prefix}pass_rate/{kind}"] = float(np.mean([e.passed for e in of_kind]))
  return out


def advantages_of(episodes) -> list[float]:
  return [e.advantage for e in episodes]
