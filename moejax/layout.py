"""Which layer sits where: the kinds of the layers, and which of them the scanned stack covers.

Free of JAX, so that validating a config (moejax.config) does not import it.
"""

import math
from typing import NamedTuple


def layer_kinds(cfg) -> list[tuple[str, str]]:
  """(mixer, ffn) kind for every layer: mixer in {"kda", "mla"}, ffn in {"dense", "moe"}."""
  mixers = {"K": "kda", "M": "mla"}
  pattern = cfg.layer_pattern * (cfg.num_layers // len(cfg.layer_pattern))
  return [(mixers[p], "dense" if i < cfg.num_dense_layers else "moe") for i, p in enumerate(pattern)]


SCANNED = "scanned"  # the params subtree of the scanned layers


class LayerLayout(NamedTuple):
  """Which layers run unrolled and which in the scan: layers [start, start + period * repeats) are
  `repeats` copies of one period of `period` layers; the rest are unrolled."""
  start: int
  period: int
  repeats: int

  @property
  def stop(self) -> int:
    return self.start + self.period * self.repeats

  def unrolled(self, num_layers: int) -> list[int]:
    return [i for i in range(num_layers) if not self.start <= i < self.stop]

  def layer_index(self, repeat: int, offset: int) -> int:
    """The absolute index of layer `offset` of period `repeat`."""
    return self.start + repeat * self.period + offset


def layer_layout(cfg) -> LayerLayout:
  """The scan layout of a model config (`config.model`); repeats=0 when nothing is scanned.

  Searched over the layer kinds: the run of at least two identical periods that takes the most layers
  out of the compiled program, period * (repeats - 1), then the shortest period. With AttnRes a period
  closes whole blocks and starts on a block boundary, so the carried state has the same structure after
  every period, and layer 0 stays out (its mixer reads the embedding alone and has no query, where
  every scanned layer has one).
  """
  if not cfg.scan_layers:
    return LayerLayout(0, 1, 0)
  kinds, n = layer_kinds(cfg), cfg.num_layers
  step, first = 1, 0
  if cfg.attnres.mode == "attnres":
    step, first = cfg.attnres.block_size // math.gcd(cfg.attnres.block_size, 2), 1
  best = LayerLayout(0, 1, 0)
  for period in range(step, n + 1, step):
    for start in range(-(-first // step) * step, n - period + 1, step):
      body = kinds[start:start + period]
      repeats = 1
      while kinds[start + repeats * period:start + (repeats + 1) * period] == body:
        repeats += 1
      if repeats >= 2 and period * (repeats - 1) > best.period * max(best.repeats - 1, 0):
        best = LayerLayout(start, period, repeats)
  return best
