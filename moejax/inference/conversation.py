"""Generation over a batch of rows whose caches are kept from one turn to the next.

`generate(lm, prompts, ...)` is one turn of a fresh `Conversation`. A conversation's next turn feeds
only its new tokens (a tool's output, the user's reply) after what the rows already hold, and goes on
decoding: no token is fed twice. The last token drawn in a turn (its eos, or the one that reached
max_new_tokens) is not fed by that turn; the next turn feeds it first, so the caches always hold every
token the rows have seen or drawn, in order.
"""

import dataclasses
from collections.abc import Callable, Generator, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from moejax.data.tokenizer import IMAGE_ID
from moejax.inference.engine import Rows, bucket, cache_length, grow_cache
from moejax.inference.sampling import Sampling
from moejax.vision.batch import pack_images
from moejax.vision.prompts import expand_placeholders


@dataclasses.dataclass
class GenerateOutput:
  """Per prompt: the new tokens (prompt excluded; the eos that stopped a row included), the
  log-probability of each under the model's distribution before temperature/top-k/top-p, and why
  the row stopped: "eos" or "length" (max_new_tokens)."""

  tokens: list[list[int]]
  logprobs: list[list[float]]
  finish_reasons: list[str]


class Conversation:
  """Rows of one batch that take turns: `turn(new_tokens, ...)` appends each row's new tokens to its
  caches and generates its reply. `lm` is a `moejax.inference.LanguageModel`.

  The first turn's tokens are the prompts (each non-empty). A later turn's may be empty for a row,
  which then continues where its last reply stopped. A row left out of a turn (`active`) is fed nothing,
  draws nothing and keeps its state for a later turn. Each row may hold at most `lm.cache_len`
  tokens in all; the caches grow (in powers of two) as the turns need.
  """

  def __init__(self, lm, batch: int, *, seed: int = 0, record_routing: bool = False):
    """record_routing: keep the experts every fed position took (`routing`, for routing replay)."""
    if not isinstance(batch, int) or batch < 1:
      raise ValueError(f"a conversation needs at least one row, got batch={batch!r}")
    self.lm = lm
    self.batch = batch
    self._rows_padded = bucket(batch)
    self._keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(
        jnp.arange(self._rows_padded))
    self._rows: Rows | None = None
    self.lengths = [0] * batch  # tokens each row's caches hold
    self._unfed: list[list[int]] = [[] for _ in range(batch)]  # each row's last drawn token, not yet fed
    self.record_routing = record_routing

  def routing(self, row: int) -> np.ndarray:
    """int32 [held tokens, MoE layers, k]: the experts each token row `row` holds took when it was fed,
    in order (moejax/moe/replay.py). Needs record_routing."""
    if not self.record_routing:
      raise ValueError("this conversation does not record routing: Conversation(..., record_routing=True)")
    if self._rows is None:
      raise ValueError("nothing was fed yet")
    return np.asarray(self._rows.routing.experts_BSLK[row, :self.lengths[row]])

  def turn(self, new_tokens: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
           active: list[bool] | None = None, images: list[list] | None = None,
           on_tokens: Callable[[list[list[int]]], None] | None = None) -> GenerateOutput:
    """Feeds each row's new tokens, then draws up to max_new_tokens per row (stopping a row at eos_id).

    active: which rows take this turn (default all); a row left out must have no new tokens, draws
    none and gets finish reason "inactive".
    images: per row, the images (RGB uint8 [H, W, 3] arrays) of its new tokens, one per IMAGE placeholder
    there, in order (a model with a vision tower); each placeholder becomes its image's tokens.
    on_tokens: called with each row's tokens as they are drawn (a list per row, empty for a row that
    drew none), after every decode step; without it the whole turn decodes in one device loop.
    """
    steps = self.turn_steps(new_tokens, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, eos_id=eos_id, active=active, images=images,
                            stepwise=on_tokens is not None)
    while True:
      try:
        drawn = next(steps)
      except StopIteration as stop:
        return stop.value
      if on_tokens is not None:
        on_tokens(drawn)

  def turn_steps(self, new_tokens: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
                 active: list[bool] | None = None, images: list[list] | None = None,
                 stepwise: bool = True) -> Generator[list[list[int]], None, GenerateOutput]:
    """`turn` as a generator: checks its arguments and feeds the new tokens at once, then yields each
    row's newly drawn tokens after every decode step (`stepwise`) or once at the end, and returns
    the turn's `GenerateOutput`."""
    sampling = Sampling(temperature, top_k, top_p).checked(self.lm.vocab_size)
    active = self._active(active, new_tokens)
    encoded = None
    if images is not None:
      if not isinstance(images, (list, tuple)) or len(images) != self.batch:
        raise ValueError(f"images must be a list of image lists, one per row ({self.batch})")
      expanded = [expand_placeholders(self.lm.config, list(new_tokens[b]), list(images[b] or []))
                  for b in range(self.batch)]
      new_tokens, encoded = [e[0] for e in expanded], [e[1] for e in expanded]
    elif self.lm.config.model.vision.enabled and any(IMAGE_ID in list(row) for row in new_tokens):
      # The tokenizer of a vision model reserves IMAGE_ID: a placeholder without its image would be read
      # as the placeholder's own embedding, an image of nothing.
      raise ValueError(f"a prompt holds image placeholders (token {IMAGE_ID}) but no images were given: pass "
                       "images=[[image, ...] per row]")
    self._check(new_tokens, max_new_tokens, eos_id, active)
    feeds = [self._unfed[b] + [int(t) for t in new_tokens[b]] if active[b] else [] for b in range(self.batch)]
    need = max(n + len(f) + max_new_tokens for n, f, a in zip(self.lengths, feeds, active, strict=True) if a)
    self._prepare(need)
    self._prefill(feeds, encoded)
    for b in range(self.batch):
      if active[b]:
        self.lengths[b] += len(feeds[b])
        self._unfed[b] = []
    idle_B = np.ones((self._rows_padded,), bool)
    idle_B[:self.batch] = ~np.asarray(active)
    self._rows = self._rows._replace(done_B=jnp.asarray(idle_B), limit_B=self._rows.drawn_B + max_new_tokens)
    return self._decode(sampling, max_new_tokens, eos_id, stepwise, active)

  def _active(self, active, new_tokens) -> list[bool]:
    if active is None:
      return [True] * self.batch
    active = [bool(a) for a in active]
    if len(active) != self.batch:
      raise ValueError(f"active names {len(active)} rows, the conversation has {self.batch}")
    if not any(active):
      raise ValueError("a turn needs at least one active row")
    if self._rows is None and not all(active):
      raise ValueError("every row takes the first turn: it holds the prompts")
    for b, a in enumerate(active):
      if not a and isinstance(new_tokens, (list, tuple)) and b < len(new_tokens) and len(new_tokens[b]):
        raise ValueError(f"row {b} is left out of the turn but is given {len(new_tokens[b])} new tokens")
    return active

  def _decode(self, sampling, max_new_tokens, eos_id, stepwise, active):
    tokens, logprobs = [[] for _ in range(self.batch)], [[] for _ in range(self.batch)]
    steps = 1 if stepwise else bucket(max_new_tokens)
    eos = -1 if eos_id is None else int(eos_id)
    while True:
      self._rows, out, logp, taken = self.lm.engine.decode(self._rows, self._keys, eos, steps, sampling)
      out, logp, taken = np.asarray(out), np.asarray(logp), np.asarray(taken)
      drawn = [out[b][taken[b]].tolist() for b in range(self.batch)]
      for b in range(self.batch):
        tokens[b] += drawn[b]
        logprobs[b] += logp[b][taken[b]].tolist()
        # Every drawn token but the last is fed; the last waits for the next turn.
        self.lengths[b] += len(drawn[b])
      yield drawn
      if bool(np.all(np.asarray(self._rows.done_B))):
        break
    for b in range(self.batch):
      if active[b]:
        self.lengths[b] -= 1
        self._unfed[b] = tokens[b][-1:]
    ended = lambda row: eos_id is not None and row and row[-1] == eos_id
    reasons = ["inactive" if not a else "eos" if ended(row) else "length"
               for row, a in zip(tokens, active, strict=True)]
    return GenerateOutput(tokens, logprobs, reasons)

  def _check(self, new_tokens, max_new_tokens, eos_id, active) -> None:
    lm = self.lm
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if eos_id is not None and not (isinstance(eos_id, int) and 0 <= eos_id < lm.vocab_size):
      raise ValueError(f"eos_id must be None or a token id in [0, {lm.vocab_size}), got {eos_id!r}")
    if not isinstance(new_tokens, (list, tuple)) or len(new_tokens) != self.batch:
      got = f"{len(new_tokens)} lists" if isinstance(new_tokens, (list, tuple)) else type(new_tokens).__name__
      raise ValueError(f"give a list of token lists, one per row ({self.batch}), got {got}")
    for b, row in enumerate(new_tokens):
      row = list(row)
      if self._rows is None and not row:
        raise ValueError(f"prompt {b} is empty: a prompt needs at least one token (a BOS, at least)")
      bad = [t for t in row if not (isinstance(t, (int, np.integer)) and 0 <= t < lm.vocab_size)]
      if bad:
        raise ValueError(f"prompt {b} holds token ids outside the vocabulary [0, {lm.vocab_size}): {bad[:5]}")
      total = self.lengths[b] + len(self._unfed[b]) + len(row) + max_new_tokens
      if active[b] and total > lm.cache_len:
        raise ValueError(f"row {b}: {self.lengths[b] + len(self._unfed[b])} tokens held, {len(row)} new and "
                         f"max_new_tokens={max_new_tokens} make {total}, beyond the cache's "
                         f"{lm.cache_len} positions (inference.cache_len; load_model(..., cache_len=N))")

  def _prepare(self, need: int) -> None:
    """Caches with room for `need` positions a row: made on the first turn, grown on a later one."""
    length = min(bucket(need, 16), self.lm.cache_len)
    if self._rows is None:
      self._rows = Rows.empty(self.lm.model.cfg, self._rows_padded, length, self.record_routing)
    elif cache_length(self._rows.cache) < length or (
        self.record_routing and self._rows.routing.experts_BSLK.shape[1] < length):
      routing = None if self._rows.routing is None else self._rows.routing.grown(length)
      self._rows = self._rows._replace(cache=grow_cache(self._rows.cache, length), routing=routing)

  def _prefill(self, feeds: list[list[int]], encoded: list[list] | None = None) -> None:
    """Feeds the rows' tokens in pieces of one bucketed length (at most inference.prefill_chunk). With
    images (`encoded`: per row, (patches, coords) of each image of its feed, in order), the whole feed
    is embedded first, its images in place, and the embeddings are fed in the same pieces."""
    longest = max(len(f) for f in feeds)
    if not longest:
      return
    piece = min(bucket(longest, 16), self.lm.prefill_chunk)
    B = self._rows_padded
    if encoded is not None and any(encoded):
      self._prefill_with_images(feeds, encoded, piece)
      return
    for start in range(0, longest, piece):
      tokens = np.zeros((B, piece), np.int32)
      lengths = np.zeros((B,), np.int32)
      for b, f in enumerate(feeds):
        part = f[start:start + piece]
        tokens[b, :len(part)] = part
        lengths[b] = len(part)
      self._rows = self.lm.engine.prefill(self._rows, jnp.asarray(tokens), jnp.asarray(lengths))

  def _prefill_with_images(self, feeds, encoded, piece: int) -> None:
    v = self.lm.config.model.vision
    B, longest = self._rows_padded, max(len(f) for f in feeds)
    width = -(-longest // piece) * piece
    tokens = np.zeros((B, width), np.int32)
    for b, f in enumerate(feeds):
      tokens[b, :len(f)] = f
    group = v.merge * v.merge
    capacity = bucket(max(sum(len(p) for p, _ in row) for row in encoded), group)
    packed = [pack_images(row, capacity, v.patch_size * v.patch_size * 3) for row in encoded]
    packed += [pack_images([], capacity, v.patch_size * v.patch_size * 3)] * (B - len(packed))
    images = {name: jnp.asarray(np.stack([p[i] for p in packed])) for i, name in enumerate(("patches", "ids",
                                                                                           "coords"))}
    embeddings = self.lm.engine.embed_images(jnp.asarray(tokens), images)
    for start in range(0, longest, piece):
      lengths = np.array([max(0, min(len(f) - start, piece)) for f in feeds] + [0] * (B - len(feeds)),
                         np.int32)
      self._rows = self.lm.engine.prefill_embedded(self._rows, embeddings[:, start:start + piece],
                                                   jnp.asarray(lengths))


def generate(lm, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             seed: int = 0, images: list[list] | None = None) -> GenerateOutput:
  """New tokens for each prompt (a list of token ids), all prompts decoded together as one batch.
  images: per prompt, its images, one per IMAGE placeholder in it (`Conversation.turn`).

  temperature 0 is greedy; otherwise tokens are drawn after temperature, top-k and top-p
  (`moejax.inference.sampling`), from `seed`. A row stops at eos_id (included in its tokens) or after
  max_new_tokens."""
  if not isinstance(prompts, (list, tuple)) or not prompts:
    raise ValueError("prompts must be a non-empty list of token-id lists")
  return Conversation(lm, len(prompts), seed=seed).turn(
      [list(p) for p in prompts], max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
      top_p=top_p, eos_id=eos_id, images=images)


def stream(lm, prompt: list[int], *, max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
           seed: int = 0) -> Iterator[int]:
  """The new tokens of one prompt, yielded as they are drawn: the tokens `generate` gives it. The
  arguments are checked and the prompt prefilled here, before the first token is asked for."""
  steps = Conversation(lm, 1, seed=seed).turn_steps(
      [list(prompt)], max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
      eos_id=eos_id, stepwise=True)
  return (t for drawn in steps for t in drawn[0])
