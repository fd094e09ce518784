"""Tiny hybrid MoE for CPU: trains on the embedded stdlib corpus in a few minutes.

python -m moejax.train --config experiments/tiny.py --workdir /tmp/tiny
"""

from moejax.config import base_config


def get_config():
  c = base_config()
  m = c.model
  c.data.vocab_size = 1024  # the model's vocab_size follows
  m.d_model = 64
  m.num_layers = 4
  m.layer_pattern = "KKKM"
  m.num_dense_layers = 1
  m.kda.num_heads = 4
  m.kda.head_k_dim = 16
  m.kda.head_v_dim = 16
  m.kda.chunk_size = 64
  m.mla.num_heads = 4
  m.mla.q_lora_rank = 32
  m.mla.kv_lora_rank = 16
  m.mla.qk_nope_head_dim = 16
  m.mla.v_head_dim = 16
  m.attnres.block_size = 4  # 2 layers per block
  m.ffn.hidden_dim = 128
  m.moe.num_experts = 8
  m.moe.top_k = 2
  m.moe.num_shared = 1
  m.moe.shared_hidden_dim = 64
  m.moe.latent_dim = 32
  m.moe.expert_hidden_dim = 32
  c.train.stages = ((128, 120, 2048),)  # about 250K tokens: a few minutes on two CPU cores
  return c
