"""Transcripts -> the arrays of an update step (`moejax.rl.objective`) or of an SFT step.

Row b holds transcript b shifted by one: position t reads token t and predicts token t + 1, so every
per-token field describes the target: whether the policy drew it, its log-probability and version.
Rows are padded at their end (segment id 0) to a power-of-two length of at least 16 and, with `rows`,
padded with empty rows to a fixed count: the step compiles once per length bucket, not per batch.
"""

import numpy as np

from moejax.inference.engine import bucket
from moejax.moe.replay import NOT_REPLAYED
from moejax.rl.grpo import aggregation_weights


def update_batch(transcripts, advantages, *, version: int, aggregation: str, rows: int | None = None,
                 length: int | None = None, routing: tuple[int, int] | None = None) -> dict:
  """The arrays of one policy update over `transcripts` (each a `Transcript`), `advantages` one per
  transcript; `version`: the current policy's (its tokens are `fresh`). routing = (MoE layers, k): also
  "replay_experts" [rows, T, layers, k], each input position's recorded experts (-1 where none was
  recorded: it routes itself)."""
  n = len(transcripts)
  if n == 0 or len(advantages) != n:
    raise ValueError(f"{n} transcripts and {len(advantages)} advantages: need as many, at least one")
  rows = n if rows is None else rows
  if rows < n:
    raise ValueError(f"{n} transcripts do not fit {rows} rows")
  longest = max(len(t) - 1 for t in transcripts)
  if longest < 1:
    raise ValueError("a transcript needs at least two tokens to make one prediction")
  T = max(bucket(longest, 16), length or 0)
  tokens = np.zeros((rows, T), np.int32)
  targets = np.zeros((rows, T), np.int32)
  segments = np.zeros((rows, T), np.int32)
  policy = np.zeros((rows, T), np.float32)
  old_logp = np.zeros((rows, T), np.float32)
  fresh = np.zeros((rows, T), np.float32)
  adv = np.zeros((rows,), np.float32)
  for b, t in enumerate(transcripts):
    m = len(t) - 1
    ids = np.asarray(t.tokens, np.int32)
    tokens[b, :m], targets[b, :m], segments[b, :m] = ids[:-1], ids[1:], 1
    policy[b, :m] = np.asarray(t.policy_mask[1:], np.float32)
    old_logp[b, :m] = np.asarray(t.logprobs[1:], np.float32)
    fresh[b, :m] = policy[b, :m] * (np.asarray(t.versions[1:]) == version)
    adv[b] = advantages[b]
  extra = {}
  if routing is not None:
    replayed = np.full((rows, T, *routing), NOT_REPLAYED, np.int32)
    for b, t in enumerate(transcripts):
      n = min(len(t) - 1, len(t.routing))
      if n:
        replayed[b, :n] = np.asarray(t.routing[:n], np.int32).reshape(n, *routing)
    extra["replay_experts"] = replayed
  return {**extra, "tokens": tokens, "targets": targets, "segment_ids": segments, "policy_mask": policy,
          "loss_mask": np.asarray(aggregation_weights(policy, aggregation), np.float32), "old_logp": old_logp,
          "fresh": fresh, "advantages": adv}


def sft_batch(transcripts, *, length: int) -> dict:
  """Next-token arrays of `transcripts` in rows of `length`, the loss on the policy's (assistant) tokens
  only: the train step's default objective reads tokens, targets, segment_ids and loss_mask."""
  for t in transcripts:
    if len(t) - 1 > length:
      raise ValueError(f"a transcript of {len(t)} tokens does not fit rows of {length} (rl.sft.seq_len)")
  b = update_batch(transcripts, np.zeros(len(transcripts)), version=-2, aggregation="token-mean",
                   length=length)
  if b["tokens"].shape[1] != length:
    raise ValueError(f"rl.sft.seq_len={length} must be a power of two >= 16")
  return {k: b[k] for k in ("tokens", "targets", "segment_ids", "loss_mask")}
