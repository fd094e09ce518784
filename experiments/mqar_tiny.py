"""The long-context claim on CPU: the tiny hybrid trained on multi-query associative recall at 256 tokens,
then asked at 1K, 4K and 16K tokens (the same 16 pairs, queried from further away).

python -m moejax.train --config experiments/mqar_tiny.py --workdir runs/mqar_tiny
python -m moejax.evaluate --workdir runs/mqar_tiny --task mqar --lengths 256,1024,4096,16384

The ablations of `python -m benchmarks.long_context` override this config: MLA with RoPE
(model.mla.rope_head_dim), KDA only and MLA only (model.layer_pattern), and the unbounded KDA gate
(model.kda.gate, with the recurrent implementation).
"""

import pathlib

from moejax.config import load_experiment


def get_config():
  c = load_experiment(pathlib.Path(__file__).with_name("tiny.py"))
  c.data.source = "mqar"  # rows drawn by moejax.data.mqar: no corpus
  c.data.vocab_size = 384  # 4 special ids, 128 keys, 128 values, 64 filler ids, and room
  c.data.mqar.pairs = 16
  c.optim.warmup_steps = 50
  c.train.stages = ((256, 1500, 8192),)  # 32 rows a step
  c.train.eval_every = 500
  c.train.checkpoint_every = 500
  return c
