"""How much of the accelerator's memory a process lets XLA take, and what to change when a step does not fit.

JAX's GPU allocator takes 75% of the card by default. The large configs need more: on an 80 GiB H100
the 8K step of experiments/h200.py peaks at 70.8 GiB (BENCHMARKS.md), which fails at 75% (60 GiB) and
fits at 95%. The entry points that run big steps (`python -m moejax.train`, benchmarks/step.py) ask
for `default_memory_fraction()` unless the user chose the allocator's settings.

The settings are read once, when JAX starts its backend (the first device query or computation, not
the import), so `use_default_memory_fraction` must run before that.
"""

import os

DEFAULT_MEMORY_FRACTION = 0.95

# Any of these set by the user means they chose how the allocator behaves: leave all of them alone.
ALLOCATOR_VARIABLES = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                       "XLA_PYTHON_CLIENT_ALLOCATOR")


def default_memory_fraction() -> float:
  """The fraction of accelerator memory the entry points let XLA take."""
  return DEFAULT_MEMORY_FRACTION


def use_default_memory_fraction(environ=None) -> bool:
  """Sets XLA_PYTHON_CLIENT_MEM_FRACTION to `default_memory_fraction()` in `environ` (os.environ)
  unless one of ALLOCATOR_VARIABLES is already set; returns whether it set it."""
  environ = os.environ if environ is None else environ
  if any(name in environ for name in ALLOCATOR_VARIABLES):
    return False
  environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(default_memory_fraction())
  return True


class DeviceOutOfMemoryError(RuntimeError):
  """A step or evaluation ran out of accelerator memory; the message names the settings to change."""


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA's out-of-memory failure (raised as jax.errors.JaxRuntimeError)."""
  import jax  # here, not at the top: this module must stay importable before JAX is configured

  text = str(error)
  return isinstance(error, jax.errors.JaxRuntimeError) and ("RESOURCE_EXHAUSTED" in text
                                                             or "Out of memory" in text)


def out_of_memory_message(config, stage, where: str) -> str:
  """What to change when `where` (e.g. "the train step of stage 0") ran out of memory, with the
  config's current values so the next try can be chosen without opening the config."""
  seq_len, _, tokens = stage
  m, t = config.model, config.train
  fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset: JAX's default 0.75")
  rows = tokens // seq_len
  rows_per_pass = min(rows, t.microbatch_tokens // seq_len or rows) if t.microbatch_tokens else rows
  # The passes of a step must be equal, so fewer rows a pass means a divisor of the step's rows.
  fewer = max((d for d in range(1, rows_per_pass) if rows % d == 0), default=None)
  accumulate = (f"  --config.train.microbatch_tokens={fewer * seq_len}  gradient accumulation: the batch in "
                f"passes of {fewer} rows (now {t.microbatch_tokens}; 0 is one pass)" if fewer else
                f"  train.microbatch_tokens (now {t.microbatch_tokens}) already takes one row a pass: "
                f"shorten the rows or chunk them (below)")
  return "\n".join([
      f"{where} ran out of accelerator memory (stage {tuple(stage)}: seq_len={seq_len}, "
      f"{tokens} tokens a step). Ways to fit it:",
      accumulate,
      f"  --config.model.remat=dots or =full  recompute activations in the backward (now {m.remat!r})",
      f"  --config.model.moe.token_chunk / --config.model.ffn.token_chunk / --config.model.kda.seq_chunk  "
      f"for long rows: the experts, dense FFN and KDA in chunks (now {m.moe.token_chunk}, "
      f"{m.ffn.token_chunk}, {m.kda.seq_chunk}; 0 is off)",
      "  a smaller batch in --config.train.stages (the third number of each stage)",
      f"  XLA_PYTHON_CLIENT_MEM_FRACTION=0.98 (environment): more of the card for XLA (now {fraction})",
  ])
