"""Generation speed of experiments/h200.py (random weights): prefill, decode, and the cache's size.

python -m benchmarks.generate [--config experiments/h200.py] [--out BENCHMARKS.md] [--smoke]

- Prefill: tokens/s of one prompt of 8K and of 128K tokens fed into fresh caches (`Engine.prefill`, in
  pieces of inference.prefill_chunk), against the plain forward pass of the model over the same 8K
  tokens (`Transformer.__call__` without a cache, what training runs forward), timed in the same call.
- Decode: tokens/s of the on-device decode loop (`Engine.decode`, greedy, 32 steps a call) at batch 1,
  16 and 128 with 4K and 128K tokens of context in every row. The caches are filled with random values
  and marked as holding the context (a decode step's time does not depend on what they hold; a
  prefill of 128 x 128K tokens would take minutes).
- Floor of a decode step: the bytes it must move once, over the copy rate measured in the same call:
  the weights it reads (all but the routed experts and the embedding table; of the routed experts,
  those its tokens choose, E (1 - (1 - k/E)^B) per layer when B tokens route uniformly; one embedding
  row per token), the MLA latents of the context, and the KDA states read and written.
- Cache: bytes per token of context against a plain multi-head KV cache of the same model
  (`moejax.inference.footprint`).
"""

import argparse
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp

from benchmarks.report import provenance, publish
from benchmarks.step import XLA_FLAGS
from benchmarks.timing import copy_bandwidth, time_ms
from moejax.config import load_experiment, validate
from moejax.inference import random_model
from moejax.inference.engine import Rows
from moejax.inference.footprint import footprint
from moejax.inference.sampling import Sampling
from moejax.layout import layer_kinds
from moejax.model import init_cache

ROOT = pathlib.Path(__file__).resolve().parent.parent
DECODE_STEPS = 32  # decode steps per timed call


def _log(*parts):
  print(time.strftime("%H:%M:%S"), *parts, flush=True)


def filled_rows(lm, batch: int, context: int, room: int, seed: int = 0) -> Rows:
  """Rows whose caches hold `context` tokens of random content, with room for `room` more."""
  shapes = jax.eval_shape(lambda: init_cache(lm.model.cfg, batch, context + room))
  key = iter(jax.random.split(jax.random.key(seed), 4096))

  def fill(path, x):  # made leaf by leaf from its shape: no second copy of the cache is ever held
    name = getattr(path[-1], "key", getattr(path[-1], "name", None))
    if name == "length":
      return jnp.full(x.shape, context, x.dtype)
    if jnp.issubdtype(x.dtype, jnp.floating):  # drawn in its own dtype: no float32 copy of the cache
      return 0.1 * jax.random.normal(next(key), x.shape, x.dtype)
    return jnp.zeros(x.shape, x.dtype)  # document ids of the KDA history: the row goes on

  cache = jax.tree_util.tree_map_with_path(fill, shapes)
  logits = jax.random.normal(next(key), (batch, lm.vocab_size), jnp.float32)
  return Rows(cache, logits, jnp.zeros((batch,), bool), jnp.zeros((batch,), jnp.int32),
              jnp.full((batch,), 1 << 30, jnp.int32))


def feed_prompt(lm, rows, tokens_1L):
  """`rows` (one row's caches) after the prompt [1, L] is fed through the prefill path, lm.prefill_chunk
  tokens a call (the last piece what remains); waits for the last piece."""
  length = tokens_1L.shape[1]
  for start in range(0, length, lm.prefill_chunk):
    piece = tokens_1L[:, start:start + lm.prefill_chunk]
    rows = lm.engine.prefill(rows, piece, jnp.full((1,), piece.shape[1], jnp.int32))
  return jax.block_until_ready(rows)


def time_prefill(lm, length: int, repeats: int = 3) -> float:
  """Seconds to feed one prompt of `length` tokens into fresh caches (all its pieces); best of repeats
  after one untimed run (compiles)."""
  tokens = jax.random.randint(jax.random.key(1), (1, length), 3, lm.vocab_size, jnp.int32)
  best = math.inf
  for r in range(repeats + 1):
    rows = jax.block_until_ready(Rows.empty(lm.model.cfg, 1, length))
    t0 = time.perf_counter()
    rows = feed_prompt(lm, rows, tokens)
    if r:
      best = min(best, time.perf_counter() - t0)
    del rows
  return best


def time_forward(lm, length: int) -> float:
  """Seconds of the plain forward pass (no cache) over one row of `length` tokens, to the hidden states."""
  forward = jax.jit(lambda v, t: lm.model.apply(v, t)[0])
  tokens = jax.random.randint(jax.random.key(1), (1, length), 3, lm.vocab_size, jnp.int32)
  return time_ms(forward, lm.variables, tokens) / 1e3


def time_decode(lm, batch: int, context: int, calls: int = 3) -> float:
  """Seconds per decode step (every row drawing one token), the mean over `calls` timed calls of
  DECODE_STEPS steps after one untimed call."""
  rows = filled_rows(lm, batch, context, room=DECODE_STEPS * (calls + 1))
  keys = jax.random.split(jax.random.key(0), batch)
  sampling = Sampling()
  rows, *_ = lm.engine.decode(rows, keys, -1, DECODE_STEPS, sampling)
  jax.block_until_ready(rows.logits_BV)
  t0 = time.perf_counter()
  for _ in range(calls):
    rows, tokens, _, _ = lm.engine.decode(rows, keys, -1, DECODE_STEPS, sampling)
  jax.block_until_ready(tokens)
  return (time.perf_counter() - t0) / (calls * DECODE_STEPS)


def decode_floor_bytes(lm, batch: int, context: int) -> dict:
  """What one decode step of `batch` rows at `context` tokens must move once, in bytes."""
  cfg = lm.model.cfg
  weights = experts = 0
  for path, x in jax.tree_util.tree_flatten_with_path(lm.variables["params"])[0]:
    name = jax.tree_util.keystr(path)
    size = x.size * x.dtype.itemsize
    if "expert_" in name:
      experts += size
    elif name == "['embedding']":
      weights += batch * x.shape[1] * x.dtype.itemsize
      if cfg.tie_embeddings:
        weights += size  # the tied head reads the whole table
    else:
      weights += size
  E, k = cfg.moe.num_experts, cfg.moe.top_k
  touched = E * (1 - (1 - k / E) ** batch)
  kinds = [m for m, _ in layer_kinds(cfg)]
  itemsize = jnp.dtype(cfg.dtype).itemsize
  latents = batch * kinds.count("mla") * context * cfg.mla.kv_lora_rank * itemsize
  kc = cfg.kda
  states = 2 * batch * kinds.count("kda") * kc.num_heads * kc.head_k_dim * kc.head_v_dim * 4
  return {"weights": weights + experts * touched / E, "latents": latents, "states": states}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(ROOT / "experiments" / "h200.py"))
  parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU); prints, writes no table")
  args = parser.parse_args()
  # cuBLAS for the dense matmuls, as the step benchmark runs them (benchmarks/step.py says why); set
  # before the backend starts.
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), XLA_FLAGS])
  config = validate(load_experiment(args.config))
  if args.smoke:
    args.config = str(ROOT / "experiments" / "tiny.py")
    config = validate(load_experiment(args.config))
    prompts, contexts, batches = (64, 256), (64, 256), (1, 4)
    config.inference.prefill_chunk = 64
  else:
    if jax.default_backend() != "gpu":
      raise SystemExit("benchmarks/generate.py needs a GPU; use --smoke on the CPU")
    prompts, contexts, batches = (8192, 131072), (4096, 131072), (1, 16, 128)
  device = jax.devices()[0].device_kind
  lm = random_model(config, cache_len=max(contexts + prompts) + DECODE_STEPS * 8)
  bandwidth = copy_bandwidth(1 if args.smoke else 2)
  _log(f"{device}: copy rate {bandwidth / 1e12:.2f} TB/s")

  lines = provenance(device) + [
      f"Model `{pathlib.Path(args.config).name}` (random weights, {config.model.dtype}), batch 1 prompts; "
      f"prefill in pieces of {config.inference.prefill_chunk:,} tokens. The plain forward is "
      "`Transformer.__call__` over the same row without a cache. Copy rate measured in the same call: "
      f"{bandwidth / 1e12:.2f} TB/s.", "",
      "| prompt tokens | prefill s | prefill tokens/s | plain forward tokens/s | prefill / forward |",
      "|---|---|---|---|---|"]
  for n in prompts:
    prefill_s = time_prefill(lm, n)
    # The plain forward only where one pass of it fits beside the rest (it holds the whole row).
    forward_tps = n / time_forward(lm, n) if n <= config.inference.prefill_chunk else None
    forward, ratio = ("-", "-") if forward_tps is None else (f"{forward_tps:,.0f}",
                                                           f"{n / prefill_s / forward_tps:.2f}")
    lines.append(f"| {n:,} | {prefill_s:.3f} | {n / prefill_s:,.0f} | {forward} | {ratio} |")
    _log(lines[-1])

  lines += ["", f"Decode: greedy, {DECODE_STEPS} steps a call on the device (`lax.while_loop`), time per "
            "step; the floor is the bytes a step must move once over the copy rate (see the script).", "",
            "| batch | context | step ms | tokens/s | floor ms (weights / latents / states GB) "
            "| step / floor |",
            "|---|---|---|---|---|---|"]
  for context in contexts:
    for batch in batches:
      try:
        step_s = time_decode(lm, batch, context)
      except jax.errors.JaxRuntimeError as e:  # out of memory: say so in the table
        lines.append(f"| {batch} | {context:,} | did not fit: {str(e).splitlines()[0][:80]} | | | |")
        _log(lines[-1])
        continue
      b = decode_floor_bytes(lm, batch, context)
      floor_s = sum(b.values()) / bandwidth
      parts = " / ".join(f"{b[k] / 1e9:.3f}" for k in ("weights", "latents", "states"))
      lines.append(f"| {batch} | {context:,} | {step_s * 1e3:.3f} | {batch / step_s:,.0f} | "
                   f"{floor_s * 1e3:.3f} ({parts}) | {step_s / floor_s:.2f} |")
      _log(lines[-1])

  lines += ["", "Cache per row (`moejax.inference.footprint`), against a plain multi-head KV cache of the "
            "same model (every layer caching heads x (qk + v) in the compute dtype):", "",
            "| context | cache bytes | bytes per token | plain multi-head bytes per token | ratio |",
            "|---|---|---|---|---|"]
  for context in contexts:
    f = footprint(config.model, context)
    lines.append(f"| {context:,} | {f['bytes']:,} | {f['bytes_per_token']:,.0f} | "
                 f"{f['multi_head_bytes_per_token']:,} | 1/{1 / f['ratio']:.1f} |")
  publish(None if args.smoke else args.out, "Generation", lines)


if __name__ == "__main__":
  main()
