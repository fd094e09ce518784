"""Progressive long-context pretraining, 8K -> 64K -> 256K -> 1M tokens, for one H200.

python -m moejax.train --config experiments/1m.py --workdir runs/1m

The ~1B-total hybrid MoE of experiments/h200.py (3:1 KDA:MLA, 64 routed experts, quantile
balancing), with every layer rematerialised. The stages keep the batch at 512K tokens until the 1M
stage, which takes one full-length row. KDA carries position and cost linear in T; the four MLA
layers are the quadratic part at 1M for long documents; packed rows go through the Pallas
document-attention kernels (`model.mla.attention`), which skip the tiles between documents. The
embedded corpus is short files, so long stages mostly see packed documents: point data.source at
long documents for a real long-context run.
"""

import pathlib

from moejax.config import load_experiment


def get_config():
  c = load_experiment(pathlib.Path(__file__).with_name("h200.py"))
  c.model.remat = "full"
  # Each layer over its row in pieces, each piece rematerialised, so that one piece's activations are
  # live in the backward pass instead of the row's. With these pieces (and h200.py's KDA chunk of 32) a
  # 1M-token step fits one H200, where with the KDA layers whole and the routed experts' pieces in a
  # lax.map it does not (BENCHMARKS.md, "Training step at 1M tokens"; QK-clip off there, on here: see
  # benchmarks/step.py's long_config).
  # KDA in 512K pieces, not smaller: the pieces are unrolled in the compiled program, and at 128K the
  # step took several times longer to compile (same section).
  c.model.kda.seq_chunk = 524_288
  # 8M routed rows at 1M tokens (top 8): the routed experts over 128K tokens at a time; the dense FFN too.
  c.model.moe.token_chunk = 131_072
  c.model.ffn.token_chunk = 131_072
  t = c.train
  # One pass per step, as the 1M-token step was measured; passes of fewer rows at the shorter stages
  # (train.microbatch_tokens) are not measured here.
  t.microbatch_tokens = 0
  t.stages = (
      (8_192, 2_000, 524_288),
      (65_536, 500, 524_288),
      (262_144, 200, 524_288),
      (1_048_576, 100, 1_048_576),
  )
  return c
