"""A trained model, ready to generate: its config, weights, router balance state and tokenizer.

`load_model(workdir)` reads what a training run leaves in its workdir: `config.json` (the validated
run config), `tokenizer.json`, and the newest (or a given) checkpoint, of which it restores only the
parameters and the balance collection (the router biases), not the optimizer state.
"""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from moejax import storage
from moejax.config import base_config, validate
from moejax.data import tokenizer as tk
from moejax.data.config import is_synthetic
from moejax.inference.engine import Engine, bucket
from moejax.model import Transformer, build_model, init_variables
from moejax.storage import orbax_s3, resolve_workdir
from moejax.training.run_files import CONFIG_FILE, TOKENIZER_FILE


class TextTokenizer:
  """The run's byte-level BPE (moejax.data.tokenizer): text <-> token ids."""

  def __init__(self, tokenizer):
    self._tok = tokenizer
    self.pad_id, self.bos_id, self.eos_id = tk.PAD_ID, tk.BOS_ID, tk.EOS_ID
    self.vocab_size = tokenizer.get_vocab_size()

  def encode(self, text: str, *, bos: bool = True) -> list[int]:
    """The ids of `text`, after a BOS (as every training document starts) unless bos=False: pass
    bos=False for text that continues a conversation."""
    return ([self.bos_id] if bos else []) + self._tok.encode(text).ids

  def decode(self, ids) -> str:
    """The text of `ids`, special tokens (pad, BOS, EOS) left out."""
    return tk.decode(self._tok, ids)


@dataclasses.dataclass
class LanguageModel:
  """A model with its weights, ready for `moejax.inference.generate`.

  cache_len: the most tokens a row may hold (prompt, turns and new tokens); prefill_chunk: longer
  prompts are fed in pieces of this many tokens.
  """

  config: ml_collections.ConfigDict
  model: Transformer
  variables: dict  # {"params", "balance"}, unboxed
  tokenizer: TextTokenizer | None
  step: int | None
  cache_len: int
  prefill_chunk: int

  def __post_init__(self):
    self.engine = Engine(self.model, self.variables)
    self._forward = jax.jit(lambda v, t: self.model.apply(
        v, self.model.apply(v, t)[0], method=Transformer.logits))

  def load_weights(self, variables: dict) -> None:
    """Generates from `variables` ({"params", "balance"}, as training holds them) from now on, cast as
    `from_variables` casts them: the compiled programs take the weights as arguments and stay."""
    variables = {k: nn.unbox(variables[k]) for k in ("params", "balance") if k in variables}
    variables["params"] = inference_params(variables["params"], jnp.dtype(self.config.model.dtype))
    self.variables = self.engine.variables = variables

  @property
  def vocab_size(self) -> int:
    return int(self.config.model.vocab_size)

  def logits(self, tokens: list[int]) -> np.ndarray:
    """[T, vocab] float32 logits of a plain forward pass over `tokens`, no cache: the reference that
    generation is checked against. The row is padded at its end to a power of two (one compile per
    length bucket), which a causal model's outputs at the real positions cannot see."""
    tokens = [int(t) for t in tokens]
    if not tokens:
      raise ValueError("logits of an empty token list")
    bad = [t for t in tokens if not 0 <= t < self.vocab_size]
    if bad:
      raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
    padded = np.zeros((1, bucket(len(tokens), 16)), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.asarray(self._forward(self.variables, jnp.asarray(padded))[0, :len(tokens)], np.float32)


def default_cache_len(config) -> int:
  """inference.cache_len, or where it is 0, the longest sequence of the run's stages."""
  return int(config.inference.cache_len) or max(int(s[0]) for s in config.train.stages)


def inference_params(params, dtype):
  """The parameters as generation reads them: the weight matrices (2-D and up) in the compute dtype,
  which every matmul casts them to anyway, so that a decode step reads half the bytes of float32
  weights. The router's weights, which route in float32 (or as three exact bf16 parts), and the
  short convolutions' taps keep their dtype, as do the vectors (norm scales, gate biases, decays)."""
  def cast(path, x):
    name = getattr(path[-1], "key", "")
    keep = (x.ndim < 2 or name == "router" or name.startswith("conv_")
            or not jnp.issubdtype(x.dtype, jnp.floating))
    return x if keep else x.astype(dtype)

  return jax.tree_util.tree_map_with_path(cast, params)


def from_variables(config: ml_collections.ConfigDict, variables: dict, tokenizer: TextTokenizer | None = None,
                   *, step: int | None = None, cache_len: int | None = None) -> LanguageModel:
  """A `LanguageModel` of given weights (e.g. freshly initialised ones: `random_model`)."""
  model = build_model(config)  # validates
  cache_len = default_cache_len(config) if cache_len is None else cache_len
  if not isinstance(cache_len, int) or cache_len < 1:
    raise ValueError(f"cache_len must be a positive integer, got {cache_len!r}")
  variables = {k: nn.unbox(variables[k]) for k in ("params", "balance") if k in variables}
  variables["params"] = inference_params(variables["params"], jnp.dtype(config.model.dtype))
  return LanguageModel(config, model, variables, tokenizer, step, cache_len,
                       int(config.inference.prefill_chunk))


def random_model(config: ml_collections.ConfigDict, seed: int = 0, **kwargs) -> LanguageModel:
  """A `LanguageModel` of the config's freshly initialised weights (for tests and speed benchmarks)."""
  model = build_model(config)
  return from_variables(config, init_variables(model, jax.random.key(seed)), **kwargs)


def read_config(workdir: str) -> ml_collections.ConfigDict:
  """The run config a training run wrote to `workdir`, validated."""
  path = storage.join(workdir, CONFIG_FILE)
  if not storage.exists(path):
    raise FileNotFoundError(f"no {CONFIG_FILE} in {workdir}: it is not the workdir of a moejax training run "
                            f"(python -m moejax.train writes it at the start)")
  # A run from before a field existed gets its default, which is what that run trained with.
  config = ml_collections.ConfigDict(_with_defaults(json.loads(storage.read_text(path)),
                                                    base_config().to_dict()))
  return validate(config)


def _with_defaults(saved: dict, defaults: dict) -> dict:
  out = dict(saved)
  for key, value in defaults.items():
    if key not in out:
      out[key] = value
    elif isinstance(value, dict) and isinstance(out[key], dict):
      out[key] = _with_defaults(out[key], value)
  return out


def load_model(workdir: str, step: int | None = None, *, cache_len: int | None = None) -> LanguageModel:
  """The model of a training run's `workdir` at its newest checkpoint (or at `step`), its tokenizer (None
  for a run on synthetic rows), and room for `cache_len` tokens a row (default: `default_cache_len`)."""
  workdir = resolve_workdir(workdir)
  config = read_config(workdir)
  directory = storage.join(workdir, "checkpoints")
  step = checkpoint_step(directory, step)
  restored = restore_variables(directory, build_model(config), step)
  tokenizer = None  # a run on synthetic rows (data.source "mqar") has token ids but no text
  if not is_synthetic(config.data):
    mirror = storage.Mirror(workdir)  # the workdir itself, or a local copy of what is read from a URL
    mirror.pull([TOKENIZER_FILE])
    tokenizer = TextTokenizer(tk.load_tokenizer(os.path.join(mirror.local, TOKENIZER_FILE)))
  return from_variables(config, restored, tokenizer, step=step, cache_len=cache_len)


def checkpoint_step(directory: str, step: int | None = None) -> int:
  """`step` if `directory` holds its checkpoint, the newest one's if step is None; else FileNotFoundError."""
  steps = sorted(int(p.name) for p in epath.Path(directory).iterdir() if p.name.isdigit()) \
      if epath.Path(directory).is_dir() else []
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {directory}: train until the first one is saved "
                            f"(train.checkpoint_every)")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise FileNotFoundError(f"no checkpoint of step {step} in {directory}; there are {steps}")
  return step


def restore_variables(directory: str, model: Transformer, step: int) -> dict:
  """{"params", "balance"} of the checkpoint of `step` in `directory` (a training run's, or an RL run's:
  both save the train state under "state"), as saved: no optimizer state is read."""
  directory = resolve_workdir(directory)  # orbax refuses relative paths
  abstract = jax.eval_shape(lambda: init_variables(model, jax.random.key(0)))
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  on_device = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
  target = {k: jax.tree.map(on_device, nn.unbox(abstract[k])) for k in ("params", "balance") if k in abstract}
  options = ocp.CheckpointManagerOptions(**orbax_s3.manager_options(directory))
  with ocp.CheckpointManager(directory, options=options,
                             item_handlers={"state": ocp.PyTreeCheckpointHandler()}) as manager:
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)))
  return dict(restored["state"])
