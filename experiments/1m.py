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
  # 64, not the default 32: at T=1M the KDA op alone (B=1, H=16, forward + backward) asked the H200
  # for 61.25 GiB of temporaries at 32 against 46.13 GiB at 64 (2026-12-03), and this step is bounded by
  # memory. Their times at 1M were not compared.
  c.model.kda.chunk_size = 64
  # 8M routed rows at 1M tokens (top 8): run the experts over 128K tokens at a time, so one chunk's
  # rows and activations are live, not the whole row's.
  c.model.moe.token_chunk = 131_072
  # model.ffn.token_chunk and model.kda.seq_chunk stay off. Compiled on the CPU they cut one layer's
  # buffers at 1M (dense FFN 108 -> 15 GiB, KDA 173 -> 27 GiB), but on the H200 (2026-12-03) the 1M step
  # asked for 243.3 GiB with both at 128K, against 197.3 GiB without; why is not yet known. Neither fits.
  t = c.train
  t.stages = (
      (8_192, 2_000, 524_288),
      (65_536, 500, 524_288),
      (262_144, 200, 524_288),
      (1_048_576, 100, 1_048_576),
  )
  return c
