"""An episode's token record: the exact ids in the order the model saw them, and which the policy drew.

Token in, token out: the policy's tokens are the ids `generate` sampled, kept with the log-probability
the sampling policy gave each and that policy's version; the task and the tool results are encoded
once, when they enter the context, and never re-encoded from text. The loss reads this record, so
it trains on what was sampled (the importance ratio compares the same ids), and only on the policy's
tokens (`policy_mask`): tool and task tokens are context, not actions.
"""

import dataclasses

NOT_SAMPLED = -1  # the version of a context token (task, tool result): no policy drew it


@dataclasses.dataclass
class Transcript:
  tokens: list[int] = dataclasses.field(default_factory=list)
  policy_mask: list[int] = dataclasses.field(default_factory=list)  # 1: drawn by the policy
  logprobs: list[float] = dataclasses.field(default_factory=list)  # the drawing policy's; 0.0 for context
  versions: list[int] = dataclasses.field(default_factory=list)  # policy version that drew it; -1 context
  # Routing replay: per position from the first, the experts it took when the rollout fed it, its MoE
  # layers' top-k flattened (moejax/moe/replay.py); positions not fed yet (the last token) have none.
  routing: list[list[int]] = dataclasses.field(default_factory=list)

  def add_context(self, tokens) -> None:
    tokens = [int(t) for t in tokens]
    self.tokens += tokens
    self.policy_mask += [0] * len(tokens)
    self.logprobs += [0.0] * len(tokens)
    self.versions += [NOT_SAMPLED] * len(tokens)

  def add_policy(self, tokens, logprobs, version: int) -> None:
    tokens = [int(t) for t in tokens]
    if len(logprobs) != len(tokens):
      raise ValueError(f"{len(tokens)} policy tokens but {len(logprobs)} log-probabilities")
    self.tokens += tokens
    self.policy_mask += [1] * len(tokens)
    self.logprobs += [float(x) for x in logprobs]
    self.versions += [int(version)] * len(tokens)

  def add_routing(self, experts_SLK) -> None:
    """The rollout's expert choices of positions 0.. S-1 (int [S, layers, k]); positions already
    recorded keep their first record (the pass whose log-probabilities the transcript holds)."""
    for row in experts_SLK[len(self.routing):]:
      self.routing.append([int(x) for x in row.reshape(-1)])

  def __len__(self) -> int:
    return len(self.tokens)

  @property
  def policy_tokens(self) -> int:
    return sum(self.policy_mask)

  def oldest_version(self) -> int | None:
    drawn = [v for v in self.versions if v != NOT_SAMPLED]
    return min(drawn) if drawn else None

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> "Transcript":
    t = cls(list(d["tokens"]), list(d["policy_mask"]), list(d["logprobs"]), list(d["versions"]),
            [list(r) for r in d.get("routing", [])])
    if not len(t.tokens) == len(t.policy_mask) == len(t.logprobs) == len(t.versions):
      raise ValueError("a transcript's tokens, mask, log-probabilities and versions differ in length")
    if len(t.routing) > len(t.tokens):
      raise ValueError(f"a transcript of {len(t.tokens)} tokens has routing for {len(t.routing)} positions")
    return t
