"""FLOPs and the bytes each GPU sends in a step, and their times at the stated rates.

Model FLOPs per token: 6 x the active matmul parameters of `moejax.params.count_params` (the forward's
2 and the backward's 4 per parameter; the untied embedding, a lookup, and the vision tower, which runs
on image patches, left out) plus MLA's causal attention, 3 x 2 x heads x (qk + v width) x (T + 1) / 2
(rows of one document each), plus KDA's chunked form, 3 x `moejax.flops.kda_forward_flops_per_token`
per KDA layer. The routed experts run whole on every tensor rank (inside the MoE's shard_map, their
inputs split over the token axes only), so a device computes their share for its tokens; the rest is
split over `tensor`. Rematerialisation's recomputation is inside the assumed MFU, as in MFU's usual
definition.

Bytes per step per GPU, counting what each device sends:
* MoE all-to-all: per MoE layer, tokens x top_k rows of moe.latent_dim in the compute dtype, of which
  (expert - 1) / expert leave the device (balanced routing, nothing dropped), in 4 exchanges
  (dispatch and combine, forward and backward) and 2 more when remat recomputes the forward;
* all-gathers of the weights, twice a pass (forward, and again for the backward), in the parameter
  dtype: over fsdp, and inside the MoE's shard_map over every axis but the experts' own (its in_specs
  take the routed experts split over `expert` alone and its other weights whole);
* the gradients' reductions, once a pass (the accumulators keep the params' sharding): a reduce-scatter
  over fsdp and an all-reduce over the token axes that hold the same shard; inside the MoE's shard_map
  an all-reduce of the whole gathered gradient over the token axes;
* tensor-parallel all-reduces of each sublayer's [tokens, d_model] output, forward, backward and the
  remat recompute.
"""

import dataclasses
import math

import jax.numpy as jnp

from moejax.flops import kda_forward_flops_per_token
from moejax.layout import layer_kinds
from moejax.parallel.mesh import MESH_AXES, TOKEN_AXES
from moejax.params import count_params
from moejax.planning.hardware import Links
from moejax.planning.state_bytes import StateLayout

_NOT_PER_TOKEN = ("vision tower", "vision projector")  # run on image patches, not on each token


@dataclasses.dataclass(frozen=True)
class TokenFlops:
  """Model FLOPs per token, split into what a tensor rank computes whole and what it shares."""
  routed: float  # 6 x the routed experts' active parameters
  split: float  # 6 x every other active matmul parameter
  kda: float  # KDA's chunked form (3 x its forward), split over tensor by heads
  mla_heads_qkv: float  # sum over MLA layers of heads x (qk + v width): attention = 3 x that x (T + 1)

  def total(self, seq_len: int) -> float:
    return self.routed + self.split + self.kda + self.attention(seq_len)

  def attention(self, seq_len: int) -> float:
    return 3 * self.mla_heads_qkv * (seq_len + 1)

  def per_device(self, seq_len: int, tensor: int) -> float:
    """What one device computes per token of its rows."""
    return self.routed + (self.split + self.kda + self.attention(seq_len)) / tensor


def token_flops(config) -> TokenFlops:
  m = config.model
  counts = count_params(config)["components"]
  skip = _NOT_PER_TOKEN + (() if m.tie_embeddings else ("embedding",))
  routed = counts.get("moe routed experts", (0, 0))[1]
  other = sum(active for name, (_, active) in counts.items() if name not in skip) - routed
  mixers = [mixer for mixer, _ in layer_kinds(m)]
  heads_qkv = mixers.count("mla") * m.mla.num_heads * (m.mla.qk_nope_head_dim + m.mla.v_head_dim)
  kda = mixers.count("kda") * kda_forward_flops_per_token(m.kda.num_heads, m.kda.head_k_dim, m.kda.head_v_dim,
                                                          m.kda.chunk_size)
  return TokenFlops(routed=6.0 * routed, split=6.0 * other, kda=3.0 * kda, mla_heads_qkv=heads_qkv)


@dataclasses.dataclass(frozen=True)
class Transfer:
  what: str
  axes: tuple[str, ...]  # the mesh axes of the group it runs over
  pattern: str  # "ring" or "all-to-all"
  bytes: float  # sent per device per step


def moe_all_to_all(m, sizes: dict[str, int], tokens: float) -> dict[str, float]:
  """Bytes one device sends by all-to-all in a step of `tokens` tokens on it: {"forward + backward",
  "remat recompute"}."""
  e = sizes["expert"]
  moe_layers = sum(ffn == "moe" for _, ffn in layer_kinds(m))
  one = tokens * m.moe.top_k * m.moe.latent_dim * jnp.dtype(m.dtype).itemsize * (e - 1) / e
  return {"forward + backward": 4 * one * moe_layers,
          "remat recompute": (2 if m.remat != "none" else 0) * one * moe_layers}


def weight_transfers(layout: StateLayout, passes: int) -> list[Transfer]:
  """FSDP gathers and gradient reductions of every parameter, over a step."""
  out: dict[tuple, float] = {}

  def add(what, axes, nbytes):
    if nbytes:
      key = (what, tuple(a for a in MESH_AXES if a in axes and layout.sizes[a] > 1))
      out[key] = out.get(key, 0.0) + nbytes

  def ring_all_reduce(axes, nbytes):
    n = math.prod(layout.sizes[a] for a in axes)
    return 2 * (n - 1) / n * nbytes

  for p in layout.params:
    gathered = p.gathered
    g = math.prod(gathered.values())
    add("weight all-gather (2 a pass)", gathered, 2 * passes * p.shard_bytes * (g - 1))
    if p.in_moe_shard_map:
      # Inside the shard_map the weight is whole (but for its experts' split) and varies over no token
      # axis: its gradient is psum'd whole over them (moejax.nn.same_varying_axes), then sliced.
      axes = tuple(a for a in TOKEN_AXES if not (p.routed_expert and a == "expert"))
      add("gradient all-reduce (MoE shard_map)", axes, passes * ring_all_reduce(axes, g * p.grad_shard_bytes))
      continue
    # Outside it, the gather's transpose sums the fsdp devices' gradients into their shards.
    fsdp = gathered.get("fsdp", 1)
    add("gradient reduce-scatter", ("fsdp",), passes * p.grad_shard_bytes * (fsdp - 1))
    add("gradient all-reduce", p.reduced_over, passes * ring_all_reduce(p.reduced_over, p.grad_shard_bytes))
  return [Transfer(what, axes, "ring", nbytes) for (what, axes), nbytes in out.items()]


def tensor_all_reduces(m, sizes: dict[str, int], tokens: float) -> float:
  """Bytes one device sends in the tensor-parallel all-reduces of a step of `tokens` tokens on it."""
  t = sizes["tensor"]
  if t == 1:
    return 0.0
  split_outputs = sum(1 + (ffn == "dense" or m.moe.num_shared > 0) for _, ffn in layer_kinds(m))
  times = 3 if m.remat != "none" else 2
  row = tokens * m.d_model * jnp.dtype(m.dtype).itemsize
  return split_outputs * times * 2 * (t - 1) / t * row


def step_transfers(m, layout: StateLayout, tokens: float, passes: int) -> list[Transfer]:
  """Every collective of a step; `tokens` is the step's tokens on one device (all passes)."""
  a2a = moe_all_to_all(m, layout.sizes, tokens)
  return [Transfer("MoE all-to-all", ("expert",), "all-to-all", sum(a2a.values())),
          Transfer("tensor all-reduce", ("tensor",), "ring", tensor_all_reduces(m, layout.sizes, tokens)),
          *weight_transfers(layout, passes)]


def transfer_seconds(transfer: Transfer, sizes: dict[str, int], links: Links) -> float:
  if transfer.pattern == "all-to-all":
    return links.all_to_all_seconds(transfer.bytes, sizes, transfer.axes)
  return links.ring_seconds(transfer.bytes, sizes, transfer.axes)
