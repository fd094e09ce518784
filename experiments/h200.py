"""The ~1B-total hybrid MoE that one H200 trains: the model of the step benchmark and of 1m.py.

python -m moejax.train --config experiments/h200.py --workdir runs/h200
python -m benchmarks.step --config experiments/h200.py

1.35B parameters in all, 357M active per token (`python -m moejax.params --config experiments/h200.py`):
16 layers in the 3:1 KDA:MLA pattern, 64 routed LatentMoE experts (top 8, latent width 512) plus one
shared expert, quantile balancing, Muon with QK-clip. Trains at 8K context, 128K tokens per step in
four passes of 32K (gradient accumulation), 164M tokens in all.
"""

from moejax.config import base_config


def get_config():
  c = base_config()
  c.data.vocab_size = 32_768
  c.data.max_bytes = 0  # the whole standard library

  m = c.model
  m.d_model = 1024
  m.num_layers = 16
  m.layer_pattern = "KKKM"
  m.num_dense_layers = 1
  m.dtype = "bfloat16"
  m.remat = "none"
  # Unrolled: scanned (three KKKM periods), the step asks the H200 for far more memory than it has, where
  # unrolled it fits. The scan's backward keeps the AttnRes block buffer once per period
  # (docs/performance.md, "model.scan_layers").
  m.scan_layers = False
  m.kda.num_heads = 8
  m.kda.head_k_dim = 128
  m.kda.head_v_dim = 128
  m.kda.gate_rank = 128
  m.mla.num_heads = 8
  m.mla.q_lora_rank = 384
  m.mla.kv_lora_rank = 256
  m.mla.qk_nope_head_dim = 128
  m.mla.v_head_dim = 128
  m.attnres.block_size = 8  # 4 layers per block: 4 blocks over 16 layers
  m.ffn.hidden_dim = 4096
  m.moe.num_experts = 64
  m.moe.top_k = 8
  m.moe.num_shared = 1
  m.moe.shared_hidden_dim = 1024
  m.moe.latent_dim = 512
  m.moe.expert_hidden_dim = 768
  m.moe.routed_scaling = 2.5  # divided out by the latent RMSNorm but for its eps (config.py)
  m.moe.balance = "quantile"
  # The router's logits on bf16 tensor cores where the model is bf16 (W_r as three exact bf16 parts):
  # a slightly faster step than at f32 HIGHEST (moejax/moe/router.py).
  m.moe.router_matmul = "auto"
  m.loss.z_loss_weight = 1e-4

  c.optim.name = "muon"
  c.optim.lr = 0.02
  c.optim.adam_lr = 3e-4
  c.optim.warmup_steps = 50
  c.optim.qk_clip_tau = 100.0

  t = c.train
  # 128K tokens per update, in passes of 32K (4 rows): a pass holds what fits the card, and the
  # optimizer's update, about a sixth of a one-pass step, comes once per 128K tokens (BENCHMARKS.md,
  # "Training step", tokens per update). A 32K batch is also small for this model.
  t.stages = ((8_192, 1_250, 131_072),)
  t.microbatch_tokens = 32_768
  # cuBLAS for the dense matmuls, as every step benchmark of this config ran them: with XLA's own
  # Triton GEMMs autotuned the step took minutes longer to compile (moejax/config.py, xla_triton_gemm).
  t.xla_triton_gemm = False
  t.log_every = 10
  t.eval_every = 100
  t.eval_batches = 2
  t.checkpoint_every = 100
  return c
