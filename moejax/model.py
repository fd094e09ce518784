"""The hybrid decoder: embedding -> L x (AttnRes -> mixer -> AttnRes -> FFN) -> AttnRes -> RMSNorm -> head.

Mixers follow `cfg.layer_pattern` ('K' = KDA, 'M' = gated MLA, repeated over the depth); the first
`cfg.num_dense_layers` layers use a dense SiTU-GLU FFN and the rest the Stable LatentMoE FFN.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moejax.layers.attnres import AttnResQuery, ResidualState
from moejax.layers.ffn import SiTUGLU
from moejax.layers.kda import KDA
from moejax.layers.mla import GatedMLA
from moejax.layers.moe import MoE
from moejax.nn import RMSNorm, logical_param

# A block that never closes: with plain residuals the partial sum *is* the residual stream.
_NEVER = 1 << 62


def layer_kinds(cfg) -> list[tuple[str, str]]:
  """(mixer, ffn) kind for every layer: mixer in {"kda", "mla"}, ffn in {"dense", "moe"}."""
  mixers = {"K": "kda", "M": "mla"}
  pattern = cfg.layer_pattern * (cfg.num_layers // len(cfg.layer_pattern))
  return [(mixers[p], "dense" if i < cfg.num_dense_layers else "moe") for i, p in enumerate(pattern)]


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
                    name="ffn")
    return (("mixer", mixer), ("ffn", ffn))

  @nn.compact
  def __call__(self, state: ResidualState, segment_ids_BT) -> ResidualState:
    cfg = self.cfg
    attnres = cfg.attnres.mode == "attnres"
    block_size = cfg.attnres.block_size if attnres else _NEVER
    for role, sublayer in self._sublayers():
      if attnres and len(state.sources()) == 1:
        h_BTD = state.sources()[0]  # a softmax over one source is constant: no query to learn
      elif attnres:
        h_BTD = AttnResQuery(cfg.norm_eps, name=f"{role}_attnres")(state.sources())
      else:
        h_BTD = state.residual_sum()
      x_BTD = RMSNorm(cfg.norm_eps, jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype),
                      name=f"{role}_norm")(h_BTD)
      state = state.add(sublayer(x_BTD, segment_ids_BT).astype(h_BTD.dtype), block_size)
    return state


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
    layer_cls = nn.remat(DecoderLayer) if cfg.remat == "full" else DecoderLayer
    self.layers = [layer_cls(cfg, mixer, ffn, name=f"layer_{i}")
                   for i, (mixer, ffn) in enumerate(layer_kinds(cfg))]
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
    for layer in self.layers:
      state = layer(state, segment_ids_BT)
    if self.cfg.attnres.mode == "attnres":
      h_BTD = self.final_attnres(state.sources())
    else:
      h_BTD = state.residual_sum()
    return self.final_norm(h_BTD)

  def head_matrix(self):
    """[D, V] output projection (the embedding's transpose when tied)."""
    return self.embedding.T if self.cfg.tie_embeddings else self.head

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
  cfg = model.cfg.as_configdict()
  cfg.kda.implementation, cfg.mla.attention, cfg.moe.grouped_matmul = "xla", "xla", "xla"
  plain = model.clone(cfg=ml_collections.FrozenConfigDict(cfg))
  tokens = jnp.zeros((batch, seq_len), jnp.int32)
  return jax.jit(lambda r: plain.init(r, tokens, mutable=("params", "balance")))(rng)
