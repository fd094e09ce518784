"""Counts total and active parameters by abstract init (no memory is allocated).

python -m moejax.params --config experiments/k3.py

Active parameters are those one token touches: everything except the routed experts, plus top_k of
the num_experts routed experts in each MoE layer. Routed expert weights are recognised by their leading
logical axis "expert" (see moejax/layers/moe.py), not by name.
"""

import json
import math
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import app
from ml_collections import config_flags

from moejax.layout import SCANNED
from moejax.model import build_model, dummy_images
from moejax.nn import layers_lead


def _component(path: tuple[str, ...]) -> str:
  """Names the part of the model a parameter belongs to, for the table."""
  names = [str(getattr(k, "key", k)) for k in path]
  if names[0] == SCANNED:
    names = names[1:]
  if names[0] in ("embedding", "head"):
    return names[0]
  if names[0] == "vision":
    return "vision projector" if names[1].startswith("projector") else "vision tower"
  if names[0].startswith("final"):
    return "final attnres + norm"
  role = names[1] if len(names) > 1 else names[0]
  if role.endswith("_attnres"):
    return "attnres queries"
  if role.endswith("_norm"):
    return "pre-sublayer norms"
  if role == "moe":
    part = names[2]
    if part.startswith("expert_"):
      return "moe routed experts"
    if part.startswith("shared_"):
      return "moe shared experts"
    return "moe router" if part == "router" else "moe latent down/up + norm"
  return {"kda": "kda mixers", "mla": "mla mixers", "ffn": "dense ffn"}.get(role, role)


def count_params(config) -> dict:
  """Returns {"total", "active", "components": {name: (total, active)}} from abstract shapes."""
  model = build_model(config)
  tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
  images = dummy_images(config.model, 1) if config.model.vision.enabled else None
  abstract = jax.eval_shape(lambda t: model.init(jax.random.key(0), t, images=images), tokens)
  moe = config.model.moe
  active_fraction = moe.top_k / moe.num_experts
  components: dict[str, list[int]] = {}
  flat = jax.tree_util.tree_flatten_with_path(
      abstract["params"], is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
  for path, leaf in flat:
    names = leaf.names if isinstance(leaf, nn.Partitioned) else ()
    shape = nn.unbox(leaf).shape
    size = math.prod(shape)
    lead = layers_lead(names)
    routed = len(names) > lead and names[lead] == "expert" and shape[lead] == moe.num_experts
    active = round(size * active_fraction) if routed else size
    entry = components.setdefault(_component(path), [0, 0])
    entry[0] += size
    entry[1] += active
  total = sum(t for t, _ in components.values())
  active = sum(a for _, a in components.values())
  return {"total": total, "active": active, "components": {k: tuple(v) for k, v in components.items()}}


def _human(n: int) -> str:
  for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= div:
      return f"{n / div:.2f}{unit}"
  return str(n)


def format_table(counts: dict) -> str:
  rows = sorted(counts["components"].items(), key=lambda kv: -kv[1][0])
  width = max(len(k) for k in counts["components"]) + 2
  lines = [f"{'component':<{width}}{'total':>12}{'active':>12}"]
  lines += [f"{k:<{width}}{_human(t):>12}{_human(a):>12}" for k, (t, a) in rows]
  lines.append(f"{'all':<{width}}{_human(counts['total']):>12}{_human(counts['active']):>12}")
  return "\n".join(lines)


def main(argv, config_flag):
  del argv
  if config_flag.value is None:
    sys.exit("--config is required, e.g. --config experiments/k3.py")
  counts = count_params(config_flag.value)
  print(format_table(counts))
  print(json.dumps({"total": counts["total"], "active": counts["active"]}))


if __name__ == "__main__":
  # Defined here, not at import, so that importing count_params claims no global flag names.
  _config_flag = config_flags.DEFINE_config_file("config", None, "experiment config file",
                                                 lock_config=False)
  app.run(lambda argv: main(argv, _config_flag))
