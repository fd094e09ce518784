"""The hybrid decoder: embedding -> L x (AttnRes -> mixer -> AttnRes -> FFN) -> AttnRes -> RMSNorm -> head.

Mixers follow `cfg.layer_pattern` ('K' = KDA, 'M' = gated MLA, repeated over the depth); the first
`cfg.num_dense_layers` layers use a dense SiTU-GLU FFN and the rest the Stable LatentMoE FFN.

With `cfg.scan_layers`, the repeated part of the stack runs as one `nn.scan` over periods of
identical layers (params stacked on a leading "layers" axis, under "scanned"), so the program XLA
compiles holds one period instead of every layer; see `layer_layout`.
"""

import copy

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moejax.config import validate
from moejax.data.tokenizer import IMAGE_ID
from moejax.layers.attnres import AttnResQuery, ResidualState, StackedResidualState
from moejax.layers.ffn import SiTUGLU
from moejax.layers.kda import KDA, init_kda_cache
from moejax.layers.mla import GatedMLA, init_mla_cache
from moejax.layers.packing import Appended, Packing
from moejax.layout import SCANNED, LayerLayout, layer_kinds, layer_layout
from moejax.moe.layer import MoE
from moejax.nn import LAYERS_AXIS, MATMUL_NAME, RMSNorm, logical_param
from moejax.vision.encoder import VisionEncoder, place_images

# A block that never closes: with plain residuals the partial sum *is* the residual stream.
_NEVER = 1 << 62


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
  """(residual state, packing, mixer cache) -> (residual state, mixer cache): the mixer and the FFN,
  each reading its AttnRes mix (or the residual sum) through an RMSNorm."""

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
  def __call__(self, state: ResidualState | StackedResidualState, packing: Packing | None, cache=None):
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
      if role == "mixer":
        y_BTD, cache = sublayer(x_BTD, packing, cache)
      else:  # tokens appended to a cache are one document a row, as far as the FFN can tell
        y_BTD = sublayer(x_BTD, None if isinstance(packing, Appended) else packing)
      state = state.add(y_BTD.astype(h_BTD.dtype), block_size)
    return state, cache


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
  """One period of the scanned layers (`layer_layout`): the body of the scan, carrying the state.
  Its cache, when decoding, is that of each of its layers, stacked over the periods by the scan."""

  cfg: ml_collections.FrozenConfigDict
  kinds: tuple[tuple[str, str], ...]

  @nn.compact
  def __call__(self, state, packing, cache):
    new_cache = None if cache is None else {}
    for j, (mixer, ffn) in enumerate(self.kinds):
      layer = _layer_class(self.cfg)(self.cfg, mixer, ffn, name=f"layer_{j}")
      state, layer_cache = layer(state, packing, None if cache is None else cache[f"layer_{j}"])
      if cache is not None:
        new_cache[f"layer_{j}"] = layer_cache
    if isinstance(state, ResidualState):  # plain residuals never close a block: `filled` only counts
      state = ResidualState(state.blocks, state.partial, 0)
    return state, new_cache


def tied_head(embedding_VD):
  """The [D, V] head of tied embeddings: the embedding's transpose over sqrt(D). The embedding is
  drawn with std 1 and the final hidden state is RMS-normalised, so unscaled the initial logits would
  have std sqrt(D) (an initial loss far above log V); scaled, about 1, as the untied head's."""
  return embedding_VD.T * (embedding_VD.shape[1] ** -0.5)


class Transformer(nn.Module):
  """`__call__` returns the final normalised hidden states [B,T,D]; `logits` maps them to the vocab.

  The loss (`moejax.training.loss`) applies the head chunk by chunk, so [B,T,V] logits are never materialised
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
                     in_axes=(nn.broadcast, 0), length=layout.repeats,
                     metadata_params={nn.PARTITION_NAME: LAYERS_AXIS})
      self.scanned = scan(cfg, period_kinds, name=SCANNED)
    if cfg.attnres.mode == "attnres":
      self.final_attnres = AttnResQuery(cfg.norm_eps)
    self.final_norm = RMSNorm(cfg.norm_eps, jnp.dtype(cfg.dtype), pdtype)
    if cfg.vision.enabled:
      self.vision = VisionEncoder(cfg.vision, cfg.d_model, jnp.dtype(cfg.dtype), pdtype,
                                  remat=cfg.remat != "none", scan=cfg.scan_layers)

  def embed(self, tokens_BT):
    """The token embeddings of integer tokens [B,T], [B,T,D] in the compute dtype. A caller that places
    other embeddings into a row (image tokens) starts from these and passes the row as `embeddings_BTD`."""
    if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
      raise ValueError(f"tokens must be an integer [B,T] array, got {tokens_BT.dtype}{tokens_BT.shape}")
    return jnp.take(self.embedding, tokens_BT, axis=0).astype(jnp.dtype(self.cfg.dtype))

  def embed_images(self, tokens_BT, images: dict):
    """The embeddings of a row of text and images, [B,T,D]: each image placeholder (IMAGE_ID) takes the
    place of the next of its row's image tokens from the vision tower (`images`: patches, ids, coords
    as moejax.vision.batch describes)."""
    if not self.cfg.vision.enabled:
      raise ValueError("this model has no vision tower (model.vision.enabled is False): it takes no images")
    image_tokens_BMD = self.vision(images["patches"], images["ids"], images["coords"])
    return place_images(self.embed(tokens_BT), tokens_BT, image_tokens_BMD, IMAGE_ID)

  def __call__(self, tokens_BT=None, segment_ids_BT=None, *, embeddings_BTD=None, cache=None,
               lengths_B=None, images=None):
    """(final normalised hidden states [B,T,D], cache).

    The row is `tokens_BT` [B,T] embedded, or `embeddings_BTD` [B,T,D] as given: one of the two.
    images (with tokens_BT, a model with a vision tower): the row's images, whose tokens replace its
    image placeholders (`embed_images`); the decoder then reads them causally, in order, as text.
    segment_ids_BT marks the documents packed into each row (None: one a row); the layers read them
    as one `Packing`, worked out here. cache: None (the rows start here; None comes back), or the
    mixers' decode caches (`init_cache`) that the rows continue, one document a row; the caches
    after the rows' last real positions come back. lengths_B (int32 [B], with a cache): row b's
    first lengths_B[b] tokens are real and the rest padding that reaches no cache (`Appended`).
    """
    if (tokens_BT is None) == (embeddings_BTD is None):
      raise ValueError("Transformer takes either tokens_BT or embeddings_BTD, exactly one of them")
    if images is not None and tokens_BT is None:
      raise ValueError("images go with tokens_BT, whose image placeholders they fill")
    if embeddings_BTD is None:
      x_BTD = self.embed(tokens_BT) if images is None else self.embed_images(tokens_BT, images)
    else:
      if embeddings_BTD.ndim != 3 or embeddings_BTD.shape[-1] != self.cfg.d_model:
        raise ValueError(f"embeddings must be [B,T,D={self.cfg.d_model}], got {embeddings_BTD.shape}")
      x_BTD = embeddings_BTD.astype(jnp.dtype(self.cfg.dtype))
    B, T = x_BTD.shape[:2]
    packing = None if segment_ids_BT is None else Packing.of(segment_ids_BT, B, T)
    if cache is not None and packing is not None:
      raise ValueError("a decode cache holds one document a row: call the model without segment_ids")
    if lengths_B is not None:
      if cache is None:
        raise ValueError("lengths_B marks the real tokens appended to a cache: pass the cache too")
      if tuple(lengths_B.shape) != (B,):
        raise ValueError(f"lengths_B must have shape [B]=({B},), got {tuple(lengths_B.shape)}")
      packing = Appended(jnp.asarray(lengths_B, jnp.int32))
    layer_cache = lambda name: None if cache is None else cache[name]
    new_cache = None if cache is None else {}
    state = ResidualState.start(x_BTD)
    layout = layer_layout(self.cfg)
    for i, layer in zip(self.unrolled, self.layers, strict=True):
      if i == layout.stop and layout.repeats:
        state, scanned_cache = self._scan(state, packing, layer_cache(SCANNED), layout)
      state, c = layer(state, packing, layer_cache(f"layer_{i}"))
      if cache is not None:
        new_cache[f"layer_{i}"] = c
    if layout.repeats and layout.stop == self.cfg.num_layers:
      state, scanned_cache = self._scan(state, packing, layer_cache(SCANNED), layout)
    if cache is not None and layout.repeats:
      new_cache[SCANNED] = scanned_cache
    if self.cfg.attnres.mode == "attnres":
      h_BTD = self.final_attnres(state.sources())
    else:
      h_BTD = state.residual_sum()
    return self.final_norm(h_BTD), new_cache

  def _scan(self, state: ResidualState, packing, cache, layout: LayerLayout):
    cfg = self.cfg
    if cfg.attnres.mode != "attnres":
      partial = jnp.zeros_like(state.blocks[0]) if state.partial is None else state.partial
      return self.scanned(ResidualState(state.blocks, partial, 0), packing, cache)
    # Periods close whole blocks, so the scan starts and ends on a block boundary.
    num_blocks = len(state.blocks) + layout.repeats * (2 * layout.period // cfg.attnres.block_size)
    carry, cache = self.scanned(state.stacked(num_blocks), packing, cache)
    return carry.unstacked(num_blocks), cache

  def head_matrix(self):
    """[D, V] output projection: `tied_head` of the embedding when tied."""
    return tied_head(self.embedding) if self.cfg.tie_embeddings else self.head

  def logits(self, h_BTD):
    w_DV = self.head_matrix().astype(h_BTD.dtype)
    return jnp.dot(h_BTD, w_DV, preferred_element_type=jnp.float32)


def build_model(config: ml_collections.ConfigDict) -> Transformer:
  """The Transformer of a run config, which this validates (`moejax.config.validate`) first."""
  validate(config)
  return Transformer(ml_collections.FrozenConfigDict(config.model))


def init_cache(cfg, batch: int, max_len: int) -> dict:
  """Empty decode caches for a model config (`config.model`): per unrolled layer "layer_i" its mixer's
  (KDA: `KDACarry.empty`; MLA: `init_mla_cache` of `max_len` positions), and under "scanned" those of
  the scanned layers, stacked over the periods as the scan takes them."""
  one = lambda kind: init_kda_cache(cfg, batch) if kind == "kda" else init_mla_cache(cfg, batch, max_len)
  kinds, layout = layer_kinds(cfg), layer_layout(cfg)
  cache = {f"layer_{i}": one(kinds[i][0]) for i in layout.unrolled(cfg.num_layers)}
  if layout.repeats:
    period = {f"layer_{j}": one(kinds[layout.start + j][0]) for j in range(layout.period)}
    cache[SCANNED] = jax.tree.map(lambda x: jnp.stack([x] * layout.repeats), period)
  return cache


def init_variables(model: Transformer, rng: jax.Array, batch: int = 1, seq_len: int = 16):
  """Initialises params and the balance collection (router biases), jitted.

  The dummy forward pass that creates them runs the XLA implementations of every kernel (parameters do
  not depend on the implementation), so no Pallas kernel is lowered or compiled for it, and nothing
  but the two collections is returned, so XLA drops the forward pass as dead code.
  """
  cfg = copy.deepcopy(model.cfg.as_configdict())  # as_configdict shares the caller's config
  cfg.kda.implementation, cfg.mla.attention, cfg.moe.grouped_matmul = "xla", "xla", "xla"
  if cfg.kda.gate == "unbounded":  # which only the recurrence takes (also plain XLA)
    cfg.kda.implementation = "recurrent"
  cfg.kda.conv_implementation, cfg.moe.balance_implementation = "xla", "xla"
  cfg.vision.attention = "xla"
  plain = model.clone(cfg=ml_collections.FrozenConfigDict(cfg))
  tokens = jnp.zeros((batch, seq_len), jnp.int32)
  images = dummy_images(cfg, batch) if cfg.vision.enabled else None
  return jax.jit(lambda r: plain.init(r, tokens, images=images, mutable=("params", "balance")))(rng)


def dummy_images(cfg, batch: int) -> dict:
  """One image of a single merge block a row: the smallest `images` argument, for shapes and init."""
  v = cfg.vision
  group = v.merge * v.merge
  rows, cols = jnp.divmod(jnp.arange(group, dtype=jnp.int32), v.merge)
  coords = jnp.stack([rows, cols, jnp.full_like(rows, v.merge), jnp.full_like(rows, v.merge)], axis=1)
  return {"patches": jnp.zeros((batch, group, v.patch_size * v.patch_size * 3), jnp.uint8),
          "ids": jnp.ones((batch, group), jnp.int32),
          "coords": jnp.broadcast_to(coords, (batch, group, 4))}
