"""The hybrid decoder: embedding -> L x (AttnRes -> mixer -> AttnRes -> FFN) -> AttnRes -> RMSNorm -> head.

Mixers follow `cfg.layer_pattern` ('K' = KDA, 'M' = gated MLA, repeated over the depth); the first
`cfg.num_dense_layers` layers use a dense SiTU-GLU FFN and the rest the Stable LatentMoE FFN.

With `cfg.scan_layers`, the repeated part of the stack runs as one `nn.scan` over periods of
identical layers (params stacked on a leading "layers" axis, under "scanned"), so the program XLA
compiles holds one period instead of every layer; see `layer_layout`.
"""

import copy
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moejax.layers.attnres import AttnResQuery, ResidualState, StackedResidualState
from moejax.layers.ffn import SiTUGLU
from moejax.layers.kda import KDA
from moejax.layers.mla import GatedMLA
from moejax.layers.moe import MoE
from moejax.nn import LAYERS_AXIS, MATMUL_NAME, RMSNorm, logical_param

# A block that never closes: with plain residuals the partial sum *is* the residual stream.
_NEVER = 1 << 62


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


def per_layer(tree, cfg) -> dict:
  """A collection of a scanned model (params, balance, sown stats) keyed the way the unrolled model
  keys it: the "scanned"/"layer_j" subtrees, whose leaves carry a leading [repeats] axis, become
  "layer_i" subtrees for their absolute indices i. Leaves must be plain arrays (unbox params first).
  """
  if SCANNED not in tree:
    return tree
  layout = layer_layout(cfg)
  out = {k: v for k, v in tree.items() if k != SCANNED}
  for name, sub in tree[SCANNED].items():
    offset = int(name.removeprefix("layer_"))
    for r in range(layout.repeats):
      out[f"layer_{layout.layer_index(r, offset)}"] = jax.tree.map(lambda x, r=r: x[r], sub)
  return out


def stacked_layers(tree, cfg) -> dict:
  """The inverse of `per_layer`: stacks the "layer_i" subtrees of the scanned span under "scanned"."""
  layout = layer_layout(cfg)
  if not layout.repeats:
    return tree
  scanned = {}
  for offset in range(layout.period):
    names = [f"layer_{layout.layer_index(r, offset)}" for r in range(layout.repeats)]
    if any(n not in tree for n in names):
      continue  # a collection that this layer kind does not use (e.g. "attn_stats" of KDA layers)
    scanned[f"layer_{offset}"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(tree[n] for n in names))
  out = {k: v for k, v in tree.items() if not (k.startswith("layer_") and
                                                layout.start <= int(k.removeprefix("layer_")) < layout.stop)}
  return {**out, SCANNED: scanned} if scanned else out


class DecoderLayer(nn.Module):
  cfg: ml_collections.FrozenConfigDict
  mixer: str
  ffn: str

  def _sublayers(self):
    cfg, dtype, pdtype = self.cfg, jnp.dtype(self.cfg.dtype), jnp.dtype(self.cfg.param_dtype)
    mixer = {"kda": KDA, "mla": GatedMLA}[self.mixer](cfg, name=self.mixer)
    if self.ffn == "moe":
      ffn = MoE(cfg, name="moe")
    else:
      ffn = SiTUGLU(cfg.ffn.hidden_dim, cfg.ffn.situ_b1, cfg.ffn.situ_b2, dtype=dtype, param_dtype=pdtype,
                    token_chunk=cfg.ffn.token_chunk, name="ffn")
    return (("mixer", mixer), ("ffn", ffn))

  @nn.compact
  def __call__(self, state: ResidualState | StackedResidualState, segment_ids_BT):
    cfg = self.cfg
    attnres = cfg.attnres.mode == "attnres"
    block_size = cfg.attnres.block_size if attnres else _NEVER
    for role, sublayer in self._sublayers():
      if attnres and isinstance(state, ResidualState) and len(state.sources()) == 1:
        h_BTD = state.sources()[0]  # a softmax over one source is constant: no query to learn
      elif attnres:
        h_BTD = state.mix(AttnResQuery(cfg.norm_eps, name=f"{role}_attnres"))
      else:
        h_BTD = state.residual_sum()
      x_BTD = RMSNorm(cfg.norm_eps, jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype),
                      name=f"{role}_norm")(h_BTD)
      state = state.add(sublayer(x_BTD, segment_ids_BT).astype(h_BTD.dtype), block_size)
    return state


# remat=dots: saves what XLA's dots compute, and the outputs of moejax.nn.matmul, whose dots sit inside a
# custom VJP where `dots_saveable` cannot see them.
DOTS_POLICY = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names(MATMUL_NAME))


def _layer_class(cfg):
  if cfg.remat == "full":
    return nn.remat(DecoderLayer)
  if cfg.remat == "dots":
    # Matmul outputs are kept, the elementwise work between them is recomputed (custom-VJP kernels rerun
    # their forward). Scanned layers need it most: a scan saves every residual of its body, where XLA
    # fuses and recomputes the cheap ones of unrolled layers.
    return nn.remat(DecoderLayer, policy=DOTS_POLICY)
  return DecoderLayer


class LayerPeriod(nn.Module):
  """One period of the scanned layers (`layer_layout`): the body of the scan, carrying the state."""

  cfg: ml_collections.FrozenConfigDict
  kinds: tuple[tuple[str, str], ...]

  @nn.compact
  def __call__(self, state, segment_ids_BT):
    for j, (mixer, ffn) in enumerate(self.kinds):
      state = _layer_class(self.cfg)(self.cfg, mixer, ffn, name=f"layer_{j}")(state, segment_ids_BT)
    if isinstance(state, ResidualState):  # plain residuals never close a block: `filled` only counts
      state = ResidualState(state.blocks, state.partial, 0)
    return state, None


def tied_head(embedding_VD):
  """The [D, V] head of tied embeddings: the embedding's transpose over sqrt(D). The embedding is
  drawn with std 1 and the final hidden state is RMS-normalised, so unscaled the initial logits would
  have std sqrt(D) (an initial loss far above log V); scaled, about 1, as the untied head's."""
  return embedding_VD.T * (embedding_VD.shape[1] ** -0.5)


class Transformer(nn.Module):
  """`__call__` returns the final normalised hidden states [B,T,D]; `logits` maps them to the vocab.

  The loss (`moejax.loss`) applies the head chunk by chunk, so [B,T,V] logits are never materialised
  for long sequences.
  """

  cfg: ml_collections.FrozenConfigDict

  def setup(self):
    cfg = self.cfg
    pdtype = jnp.dtype(cfg.param_dtype)
    self.embedding = logical_param(self, "embedding", nn.initializers.normal(1.0),
                                   (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pdtype)
    if not cfg.tie_embeddings:
      self.head = logical_param(self, "head", nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
                                (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdtype)
    kinds, layout = layer_kinds(cfg), layer_layout(cfg)
    self.unrolled = layout.unrolled(cfg.num_layers)
    self.layers = [_layer_class(cfg)(cfg, *kinds[i], name=f"layer_{i}") for i in self.unrolled]
    if layout.repeats:
      period_kinds = tuple(kinds[layout.start:layout.start + layout.period])
      scan = nn.scan(LayerPeriod, variable_axes={True: 0}, split_rngs={"params": True},
                     in_axes=nn.broadcast, length=layout.repeats,
                     metadata_params={nn.PARTITION_NAME: LAYERS_AXIS})
      self.scanned = scan(cfg, period_kinds, name=SCANNED)
    if cfg.attnres.mode == "attnres":
      self.final_attnres = AttnResQuery(cfg.norm_eps)
    self.final_norm = RMSNorm(cfg.norm_eps, jnp.dtype(cfg.dtype), pdtype)

  def __call__(self, tokens_BT, segment_ids_BT=None):
    if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
      raise ValueError(f"tokens must be an integer [B,T] array, got {tokens_BT.dtype}{tokens_BT.shape}")
    if segment_ids_BT is not None and segment_ids_BT.shape != tokens_BT.shape:
      raise ValueError(f"segment_ids shape {segment_ids_BT.shape} != tokens shape {tokens_BT.shape}")
    dtype = jnp.dtype(self.cfg.dtype)
    state = ResidualState.start(jnp.take(self.embedding, tokens_BT, axis=0).astype(dtype))
    layout = layer_layout(self.cfg)
    for i, layer in zip(self.unrolled, self.layers, strict=True):
      if i == layout.stop and layout.repeats:
        state = self._scan(state, segment_ids_BT, layout)
      state = layer(state, segment_ids_BT)
    if layout.repeats and layout.stop == self.cfg.num_layers:
      state = self._scan(state, segment_ids_BT, layout)
    if self.cfg.attnres.mode == "attnres":
      h_BTD = self.final_attnres(state.sources())
    else:
      h_BTD = state.residual_sum()
    return self.final_norm(h_BTD)

  def _scan(self, state: ResidualState, segment_ids_BT, layout: LayerLayout) -> ResidualState:
    cfg = self.cfg
    if cfg.attnres.mode != "attnres":
      partial = jnp.zeros_like(state.blocks[0]) if state.partial is None else state.partial
      carry, _ = self.scanned(ResidualState(state.blocks, partial, 0), segment_ids_BT)
      return carry
    # Periods close whole blocks, so the scan starts and ends on a block boundary.
    num_blocks = len(state.blocks) + layout.repeats * (2 * layout.period // cfg.attnres.block_size)
    carry, _ = self.scanned(state.stacked(num_blocks), segment_ids_BT)
    return carry.unstacked(num_blocks)

  def head_matrix(self):
    """[D, V] output projection: `tied_head` of the embedding when tied."""
    return tied_head(self.embedding) if self.cfg.tie_embeddings else self.head

  def logits(self, h_BTD):
    w_DV = self.head_matrix().astype(h_BTD.dtype)
    return jnp.dot(h_BTD, w_DV, preferred_element_type=jnp.float32)


def build_model(config: ml_collections.ConfigDict) -> Transformer:
  from moejax.config import validate

  validate(config)
  return Transformer(ml_collections.FrozenConfigDict(config.model))


def init_variables(model: Transformer, rng: jax.Array, batch: int = 1, seq_len: int = 16):
  """Initialises params and the balance collection (router biases), jitted.

  The dummy forward pass that creates them runs the XLA implementations of every kernel (parameters do
  not depend on the implementation), so no Pallas kernel is lowered or compiled for it, and nothing
  but the two collections is returned, so XLA drops the forward pass as dead code.
  """
  cfg = copy.deepcopy(model.cfg.as_configdict())  # as_configdict shares the caller's config
  cfg.kda.implementation, cfg.mla.attention, cfg.moe.grouped_matmul = "xla", "xla", "xla"
  cfg.kda.conv_implementation, cfg.moe.balance_implementation = "xla", "xla"
  plain = model.clone(cfg=ml_collections.FrozenConfigDict(cfg))
  tokens = jnp.zeros((batch, seq_len), jnp.int32)
  return jax.jit(lambda r: plain.init(r, tokens, mutable=("params", "balance")))(rng)
