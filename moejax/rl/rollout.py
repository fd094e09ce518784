"""Multi-turn episodes of a batch, played together through one `Conversation`.

Each turn every running episode's row is fed only what is new to it (the tool result of its last
call), and the policy's reply is drawn with its log-probabilities: the caches carry each episode
from one turn to the next. Finished episodes sit out the remaining turns.

Partial rollouts: with a token budget, the episodes still running once the batch has drawn that many
tokens stop at the end of the turn (paused). Their transcripts keep the old policy's tokens,
log-probabilities and versions; resumed later under a newer policy, the whole transcript is fed
again (the caches of the old weights are not reused) and the episode goes on.
"""

import dataclasses
import time
from collections.abc import Callable

from moejax.inference.conversation import Conversation
from moejax.rl.env import ToolEnv
from moejax.rl.tasks import Task
from moejax.rl.transcript import Transcript


@dataclasses.dataclass
class Episode:
  task: Task
  group: int  # episodes of one group answer the same task; their rewards are compared
  transcript: Transcript
  turns: int = 0
  tool_calls: int = 0
  tool_errors: int = 0
  reward: float = 0.0
  done: bool = False
  truncated: bool = False  # ended by a token limit (a reply or the episode's budget), unscored
  advantage: float = 0.0  # set once its group is complete

  @property
  def passed(self) -> bool:
    return self.done and not self.truncated and self.reward >= 1.0

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["task"], d["transcript"] = dataclasses.asdict(self.task), self.transcript.to_dict()
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "Episode":
    return cls(**{**d, "task": Task(**d["task"]), "transcript": Transcript.from_dict(d["transcript"])})


def new_episode(task: Task, group: int, tokenizer, env: ToolEnv) -> Episode:
  transcript = Transcript()
  transcript.add_context(tokenizer.encode(env.reset(task), bos=True))
  return Episode(task, group, transcript)


@dataclasses.dataclass
class RolloutStats:
  sampled_tokens: int = 0
  fed_tokens: int = 0
  seconds: float = 0.0
  turns: int = 0


def play(lm, episodes: list[Episode], make_env: Callable[[], ToolEnv], *, version: int, seed: int,
         temperature: float, max_turn_tokens: int, episode_tokens: int, token_budget: int = 0,
         conversation: Callable = Conversation) -> RolloutStats:
  """Plays the unfinished `episodes` (in place) until each is done, or until the batch has drawn
  `token_budget` tokens (0: no budget), which pauses the rest at the end of that turn.
  conversation(lm, rows, seed=) makes what the turns are taken with (`Conversation`)."""
  running = [e for e in episodes if not e.done]
  stats = RolloutStats()
  if not running:
    return stats
  start = time.perf_counter()
  tok = lm.tokenizer
  envs = []
  for e in running:
    env = make_env()
    env.reset(e.task)
    env.turns = e.turns
    envs.append(env)
  conversation = conversation(lm, len(running), seed=seed)
  feeds = [list(e.transcript.tokens) for e in running]
  while True:
    active = [not e.done for e in running]
    stats.fed_tokens += sum(len(f) for f in feeds)
    out = conversation.turn(feeds, max_new_tokens=max_turn_tokens, temperature=temperature,
                            eos_id=tok.eos_id, active=active)
    stats.turns += 1
    feeds = [[] for _ in running]
    for b, e in enumerate(running):
      if not active[b]:
        continue
      drawn = out.tokens[b]
      stats.sampled_tokens += len(drawn)
      e.transcript.add_policy(drawn, out.logprobs[b], version)
      e.turns += 1
      if out.finish_reasons[b] != "eos" or len(e.transcript) > episode_tokens:  # cut, or over the budget
        e.done = e.truncated = True
        continue
      observation, reward, done, info = envs[b].step(tok.decode(drawn))
      if info["tool"] is not None or info["tool_error"]:
        e.tool_calls += 1
        e.tool_errors += int(info["tool_error"])
      if done:
        e.done, e.reward = True, float(reward)
        continue
      ids = tok.encode(observation, bos=False)
      e.transcript.add_context(ids)
      if len(e.transcript) + 1 >= episode_tokens:  # no room left for a reply
        e.done = e.truncated = True
        continue
      feeds[b] = ids
    if all(e.done for e in running) or (token_budget and stats.sampled_tokens >= token_budget):
      break
  if getattr(conversation, "record_routing", False):
    for b, e in enumerate(running):
      e.transcript.add_routing(conversation.routing(b))
  stats.seconds = time.perf_counter() - start
  return stats
