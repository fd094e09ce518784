"""What the step benchmarks build before they time anything: the experiment's config (shrunk for a
smoke run, overridden by `--set`), synthetic packed batches, the mesh, the train state (initialised on
the host, or only its shapes), the model's FLOPs per token and Muon's matrices, and the settings of the
long (1M-token) step. benchmarks/step.py times with these; tools/memory_plan.py, tools/hlo_traffic.py and
newton_schulz.py compile or count with them.
"""

import ast
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import load_experiment, validate
from moejax.flops import model_flops_per_token  # noqa: F401 - the benchmarks' import of it
from moejax.parallel import mesh as meshlib
from moejax.training.muon import matrix_sizes
from moejax.training.optimizers import muon_dimension_numbers
from moejax.training.state import init_state

LONG_SEQ = 1 << 20
LONG_CHUNK = 1 << 17  # tokens per pass of the routed experts and the dense FFNs at T=1M
LONG_KDA_PIECE = 1 << 19  # tokens per pass of a KDA layer at T=1M (experiments/1m.py says why)
_START = time.perf_counter()


def log(msg: str) -> None:
  """Progress with the seconds since start, so a run cut off by a time limit still says where it was."""
  print(f"[{time.perf_counter() - _START:6.0f} s] {msg}", flush=True)


def load_config(path: str, overrides: list[str], smoke: bool = False):
  """The experiment's get_config(), shrunk by `smoke_config` if asked, then `key=value` overrides
  (parsed to the field's type; tuples as Python literals), validated."""
  config = load_experiment(path)
  if smoke:
    config = smoke_config(config)
  for item in overrides:
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"--set wants key=value, got {item!r}")
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    old = node[leaf]
    if isinstance(old, bool):
      node[leaf] = value.lower() in ("1", "true", "yes")
    elif isinstance(old, tuple | list):
      node[leaf] = ast.literal_eval(value)  # train.stages=((8192, 10, 32768),)
    elif isinstance(old, int | float):
      node[leaf] = type(old)(value)
    else:
      node[leaf] = value
  return validate(config)


def smoke_config(config):
  """Shrinks a config to CPU size, keeping its layer pattern, balance mode, optimiser and gradient
  accumulation."""
  m = config.model
  config.data.vocab_size = 512
  m.update(d_model=64, num_layers=4, dtype="float32")
  m.kda.update(num_heads=2, head_k_dim=32, head_v_dim=32, gate_rank=16, chunk_size=64)
  m.mla.update(num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32)
  m.attnres.block_size = 4
  m.ffn.hidden_dim = 128
  m.moe.update(num_experts=8, top_k=2, shared_hidden_dim=64, latent_dim=32, expert_hidden_dim=32)
  config.train.stages = ((256, 10, 512),)
  if config.train.microbatch_tokens:
    # A config that accumulates keeps doing so: two passes of two rows, which split over a data=2 mesh.
    config.train.stages = ((256, 10, 1024),)
    config.train.microbatch_tokens = 512
  return config


def synthetic_batch(config, batch: int, seq_len: int, mean_doc: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, config.model.vocab_size, (batch, seq_len + 1), dtype=np.int32)
  lengths = rng.geometric(1.0 / max(mean_doc, 1), size=(batch, seq_len))
  segment_ids = np.zeros((batch, seq_len), np.int32)
  for b in range(batch):
    starts = np.minimum(np.cumsum(lengths[b]), seq_len)
    segment_ids[b] = 1 + np.searchsorted(starts, np.arange(seq_len), side="right")
  return {"tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
          "segment_ids": jnp.asarray(segment_ids), "loss_mask": jnp.ones((batch, seq_len), jnp.float32)}


def muon_matrices(config, params, axes) -> list[tuple[int, int, int]]:
  """(batch, reduction, output) sizes of every matrix Muon orthogonalises (none under AdamW)."""
  if config.optim.name != "muon":
    return []
  dims = jax.tree.leaves(muon_dimension_numbers(axes), is_leaf=lambda d: d is None or isinstance(d, tuple))
  return [matrix_sizes(p, d) for p, d in zip(jax.tree.leaves(params), dims, strict=True) if d is not None]


def peak_memory_bytes() -> float | None:
  stats = jax.local_devices()[0].memory_stats()
  return None if not stats else float(stats.get("peak_bytes_in_use", float("nan")))


def make_mesh(sizes: dict[str, int]):
  """A data x fsdp x expert x tensor mesh with Auto axes: XLA propagates the shardings that the
  params and the batch bring, and the MoE layer shard_maps its experts over `expert`."""
  return meshlib.make_mesh(**sizes, axis_types=(jax.sharding.AxisType.Auto,) * len(meshlib.MESH_AXES))


def parse_mesh(text: str) -> dict[str, int]:
  """"data=2,expert=4" -> {"data": 2, "expert": 4}; "" -> one device on every axis."""
  sizes = {}
  for part in filter(None, text.split(",")):
    name, sep, value = part.partition("=")
    if not sep or name not in meshlib.MESH_AXES:
      raise ValueError(f"--mesh wants axis=size pairs over {meshlib.MESH_AXES}, got {part!r}")
    sizes[name] = int(value)
  return sizes


def total_steps(config) -> int:
  return sum(s[1] for s in config.train.stages)


def init_on_host(model, config, why: str = ""):
  """init_state, run on the host CPU (the state then goes to the first local device): on the H200 the
  same jitted initialisation took 135-152 s of device time per run (2026-12-03), most of a call's
  budget before the step compiled."""
  try:
    host = jax.devices("cpu")[0]
  except RuntimeError:
    host = None
  t0 = time.perf_counter()
  log(f"initialising the state{why} on {host.platform if host else 'the accelerator (no CPU backend)'}")
  with jax.default_device(host) if host else contextlib.nullcontext():
    out = init_state(model, config, jax.random.key(0), total_steps(config))
  log(f"initialised in {time.perf_counter() - t0:.0f} s")
  return out


def abstract_state(model, config):
  """(the state's shapes, optimizer, logical axes) by tracing init_state alone: what compiling the step
  needs. The optimizer and axes are not arrays, so they leave the trace by the closure."""
  made = {}

  def state_only(rng):
    state, made["optimizer"], made["axes"] = init_state(model, config, rng, total_steps(config))
    return state

  shapes = jax.eval_shape(state_only, jax.random.key(0))
  return shapes, made["optimizer"], made["axes"]


def long_config(config, seq_len: int):
  """The settings of the long step: one row of seq_len tokens, remat full, and the layers in pieces
  (experiments/1m.py's: routed experts and dense FFNs over 128K tokens at a time, KDA layers over
  512K), each piece size kept where the config or --set chose one."""
  config.model.remat = "full"
  m = config.model
  m.moe.token_chunk = m.moe.token_chunk or min(seq_len, LONG_CHUNK)
  m.ffn.token_chunk = m.ffn.token_chunk or min(seq_len, LONG_CHUNK)
  m.kda.seq_chunk = m.kda.seq_chunk or min(seq_len, LONG_KDA_PIECE)
  # QK-clip off, and said so: where the attention is not the Pallas kernel, its max-logit statistic is a
  # blockwise O(T^2) pass of its own. (experiments/1m.py keeps it on; with the Pallas kernel the
  # statistic comes from the attention's forward pass, but no 1M step with it on has been timed.)
  config.optim.qk_clip_tau = 0.0
  config.train.stages = ((seq_len, 3, seq_len),)
  return validate(config)
