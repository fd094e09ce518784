"""Routing replay: the experts a rollout's forward passes chose, recorded per token, and the same choices
forced on the trainer's forward pass of those tokens (rl.grpo.routing_replay).

Where the rollout's decode path and the training forward differ by rounding (bf16 kernels, another
summation order), a token near a top-k boundary can take other experts in the update than when its
log-probability was sampled, and the importance ratio then compares two different networks. Replaying
the rollout's choices removes that source of mismatch; the routing weights are still the current
router's scores of the replayed experts, so the router keeps its gradient.

Two Flax collections, both keyed like the "router" stats ({"layer_i": {"moe": {...}}}):
  ROUTING  sown by each MoE layer where the apply makes it mutable: "experts" [B, T, k] int32, the
           experts each token took;
  REPLAY   read by each MoE layer where given: "experts" [B, T, k] int32, the experts to take instead;
           a token whose entries are -1 routes itself.
On the host and in batches the choices of all MoE layers travel stacked: [B, T, layers, k] int32, the
layers in order (`stack`, `unstack`). Replay needs the layers unrolled (model.scan_layers False) and the
tokens on one shard (no data, fsdp or expert split), which is how the RL loop runs.
"""

import jax.numpy as jnp

from moejax.errors import ConfigError

ROUTING = "routing"
REPLAY = "replay"
EXPERTS = "experts"
NOT_REPLAYED = -1


def moe_layers(cfg_model) -> list[str]:
  """The names of the MoE layers ("layer_i"), in layer order; ConfigError for a scanned stack."""
  if cfg_model.scan_layers:
    raise ConfigError("routing replay needs model.scan_layers=False: the scanned layers' choices are not "
                      "recorded per layer")
  return [f"layer_{i}" for i in range(cfg_model.num_dense_layers, cfg_model.num_layers)]


def stack(tree: dict, cfg_model) -> jnp.ndarray:
  """[B, T, layers, k] from a ROUTING collection ({"layer_i": {"moe": {"experts": [B, T, k]}}})."""
  return jnp.stack([tree[name]["moe"][EXPERTS] for name in moe_layers(cfg_model)], axis=2)


def unstack(experts_BTLK, cfg_model) -> dict:
  """The REPLAY collection of stacked choices [B, T, layers, k]."""
  names = moe_layers(cfg_model)
  if experts_BTLK.ndim != 4 or experts_BTLK.shape[2] != len(names):
    raise ValueError(f"replayed routing must be [B, T, {len(names)} MoE layers, k], got {experts_BTLK.shape}")
  return {name: {"moe": {EXPERTS: experts_BTLK[:, :, i]}} for i, name in enumerate(names)}
