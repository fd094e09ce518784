"""Data: corpus -> byte-level BPE -> ArrayRecord shards -> packed, sharded grain batches.

Names are loaded on first use, so `python -m moejax.data.prepare` runs its module only once.
The prepare function lives at `moejax.data.prepare.prepare`: `moejax.data.prepare` is the module.
"""

import importlib

_EXPORTS = {
    "default_data_config": "moejax.data.config",
    "validate_data_config": "moejax.data.config",
    "load_manifest": "moejax.data.prepare",
    "load_prepared_tokenizer": "moejax.data.prepare",
    "make_dataset": "moejax.data.pipeline",
    "make_iterator": "moejax.data.pipeline",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'moejax.data' has no attribute {name!r}")
  return getattr(importlib.import_module(_EXPORTS[name]), name)
