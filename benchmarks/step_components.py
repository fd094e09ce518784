"""The step's components timed alone: one layer of each kind (KDA, MLA, MoE, dense FFN), forward and
backward on the step's own shapes, the LM head with its loss, and the optimizer update; each multiplied
by how often the model holds it, and the rest of the step ("rest": AttnRes, the embedding, the balance
update, glue) by difference.
"""


import jax
import jax.numpy as jnp
import ml_collections

from benchmarks.step_setup import log
from benchmarks.timing import time_ms
from moejax.config import passes_per_step
from moejax.layers.ffn import SiTUGLU
from moejax.layers.kda import KDA
from moejax.layers.mla import GatedMLA
from moejax.layout import layer_kinds
from moejax.moe.layer import MoE
from moejax.parallel import mesh as meshlib
from moejax.training.loss import cross_entropy
from moejax.training.state import head_matrix


def layer_module(config, kind: str):
  """(module, mutable collections) of one layer of `kind` ("kda", "mla", "moe" or "ffn", the dense
  SiTU-GLU) as the train step runs it: MLA with its max-logit pass when QK-clip is on."""
  m = ml_collections.FrozenConfigDict(config.model)
  if kind == "kda":
    return KDA(m), ()
  if kind == "mla":
    return GatedMLA(m), ("attn_stats",) if config.optim.qk_clip_tau > 0 else ()
  if kind == "moe":
    return MoE(m), ("router",)
  if kind == "ffn":
    return SiTUGLU(m.ffn.hidden_dim, m.ffn.situ_b1, m.ffn.situ_b2, dtype=jnp.dtype(m.dtype),
                   param_dtype=jnp.dtype(m.param_dtype), token_chunk=m.ffn.token_chunk), ()
  raise ValueError(f"no layer kind {kind!r}")


def layer_fwd_bwd(module, mutable):
  """(params, x, segment_ids, other collections) -> (loss, (dparams, dx)) of one layer alone, with
  loss = 1e-6 * sum(y^2)."""
  def loss(p, x, seg, rest):
    out = module.apply({"params": p, **rest}, x, seg, mutable=list(mutable)) if mutable else \
        module.apply({"params": p, **rest}, x, seg)
    y = out[0] if mutable else out
    if isinstance(y, tuple):  # a mixer: (y, its decode cache, None here)
      y = y[0]
    return jnp.sum(y.astype(jnp.float32) ** 2) * 1e-6

  return jax.value_and_grad(loss, argnums=(0, 1))


def rows_per_device(config, batch, mesh) -> tuple[int, int]:
  """(passes per step, rows of one pass on one device) of the step on `batch`."""
  rows, T = batch["tokens"].shape
  passes = passes_per_step(T, rows * T, config.train.microbatch_tokens)
  return passes, rows // passes // meshlib.token_shards(mesh)


def component_times(config, batch, state, optimizer, mesh) -> list[tuple[str, int, float]]:
  """(component, count in the model, ms of one forward+backward) for each part timed alone."""
  m = ml_collections.FrozenConfigDict(config.model)
  # The step splits its rows into passes (train.microbatch_tokens) and each pass over the mesh's token
  # shards: one device's share of one pass is what a layer of the step runs on, as many times as the
  # step has passes.
  passes, B = rows_per_device(config, batch, mesh)
  batch = {k: v[:B] for k, v in batch.items()}
  T = batch["tokens"].shape[1]
  x = jax.random.normal(jax.random.key(1), (B, T, m.d_model), jnp.dtype(m.dtype))
  seg = batch["segment_ids"]
  kinds = layer_kinds(m)
  rows = []

  def layer(name, kind, count):
    module, mutable = layer_module(config, kind)
    variables = jax.jit(module.init)(jax.random.key(2), x, seg)
    rest = {k: v for k, v in variables.items() if k != "params"}
    fn = jax.jit(layer_fwd_bwd(module, mutable))
    rows.append((name, count * passes, time_ms(fn, variables["params"], x, seg, rest)))
    log(f"  timed {name}: {rows[-1][2]:.2f} ms")

  layer("KDA layer", "kda", sum(k == "kda" for k, _ in kinds))
  layer("MLA layer", "mla", sum(k == "mla" for k, _ in kinds))
  if any(f == "moe" for _, f in kinds):
    layer("MoE layer", "moe", sum(f == "moe" for _, f in kinds))
  if any(f == "dense" for _, f in kinds):
    layer("dense FFN", "ffn", sum(f == "dense" for _, f in kinds))

  head = head_matrix(state.params, m)

  def head_loss(w, h):
    return cross_entropy(h, w, batch["targets"], batch["loss_mask"], z_loss_weight=m.loss.z_loss_weight,
                         chunk=m.loss.chunk_tokens)[0]

  rows.append(("LM head + loss", passes, time_ms(jax.jit(jax.value_and_grad(head_loss, (0, 1))), head, x)))
  grads = jax.tree.map(jnp.ones_like, state.params)
  update = jax.jit(lambda g, s, p: optimizer.update(g, s, p))
  with jax.set_mesh(mesh):  # the mesh the state lives on: Muon's "auto" and its kernels' placement read it
    rows.append(("optimizer update", 1, time_ms(update, grads, state.opt_state, state.params)))
  return rows


def component_table(config, batch, state, optimizer, step_ms: float | None, mesh) -> list[str]:
  """Markdown rows of the components timed alone, with their share of a step of step_ms (if given)."""
  passes, per_device = rows_per_device(config, batch, mesh)
  of_pass = f" of one of its {passes} passes" if passes > 1 else ""
  lines = ["", f"Components timed alone (forward + backward, the step's shapes; one device's rows{of_pass}, "
           f"{per_device} of {batch['tokens'].shape[0]}; counts per step):", "",
           "| component | count | ms each | ms in all | share of the step |", "|---|---|---|---|---|"]
  accounted = 0.0
  for name, count, ms in component_times(config, batch, state, optimizer, mesh):
    accounted += count * ms
    share = f"{count * ms / step_ms:.0%}" if step_ms else "-"
    lines.append(f"| {name} | {count} | {ms:.2f} | {count * ms:.1f} | {share} |")
  if step_ms:
    rest = step_ms - accounted
    what = "AttnRes, embedding, balance, glue" + (", gradient accumulation" if passes > 1 else "")
    lines.append(f"| rest ({what}) | | | {rest:.1f} | {rest / step_ms:.0%} |")
  else:
    lines.append(f"| sum | | | {accounted:.1f} | - |")
  return lines
