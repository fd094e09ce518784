"""The full-scale shape (reported: Kimi K3, 2.78T total / 104.2B active parameters).

For abstract init only (`python -m moejax.params --config experiments/k3.py`): it does not fit one GPU.
Every dimension below is either reported (R) or assumed by us (A) to land the reported totals; the
assumptions are what a reader should question first.
"""

from moejax.config import base_config


def get_config():
  c = base_config()
  m = c.model
  c.data.vocab_size = 163_840  # R "about 160K"; A: 160 * 1024. model.vocab_size follows it
  m.d_model = 7168  # R
  m.num_layers = 93  # R: 69 KDA + 24 gated MLA
  # R 3:1 KDA:MLA. A: layer 0 is the extra MLA layer (93 = 1 + 23 * 4), then KKKM repeated.
  m.layer_pattern = "M" + "KKKM" * 23
  m.num_dense_layers = 1  # R: layer 0 dense
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.remat = "full"
  m.scan_layers = True  # six 12-layer periods (one AttnRes block each) in one scan, from layer 12

  m.kda.num_heads = 96  # R: 96 heads
  m.kda.head_k_dim = 128  # A: K = V = 128 as in the public KDA models
  m.kda.head_v_dim = 128  # A
  m.kda.gate_rank = 128  # A: low-rank width of decay and output gates = head dim
  m.kda.conv_size = 4  # R

  m.mla.num_heads = 96  # R
  m.mla.q_lora_rank = 1536  # R
  m.mla.kv_lora_rank = 512  # R
  m.mla.qk_nope_head_dim = 128  # R
  m.mla.v_head_dim = 128  # R

  m.attnres.block_size = 24  # R: 12 layers per block = 24 sublayers

  m.ffn.hidden_dim = 18_432  # A: dense layer-0 FFN width as in DeepSeek-V3-style models

  m.moe.num_experts = 896  # R
  m.moe.top_k = 16  # R
  m.moe.num_shared = 2  # R: two full-width shared experts
  m.moe.shared_hidden_dim = 4096  # A: chosen with the totals below
  m.moe.latent_dim = 3584  # R: d/2
  m.moe.expert_hidden_dim = 3072  # R
  m.moe.routed_scaling = 2.5  # A; divided out by the latent RMSNorm but for its eps (config.py)

  # Native vision input (R: a MoonViT-class encoder of about 400M parameters; 14 x 14 patches, 2 x 2
  # merge). A: a SigLIP-so400m-shaped tower (width 1152, 27 blocks, MLP 4304, 16 heads) and a 64 x 64
  # position table; the projector's hidden width is d_model.
  c.data.image_token = True
  c.data.images.source = "embedded"
  c.data.images.patches_per_row = 16_384
  v = m.vision
  v.enabled = True
  v.patch_size = 14  # R
  v.merge = 2  # R
  v.width = 1152  # A
  v.depth = 27  # A
  v.num_heads = 16  # A
  v.mlp_dim = 4304  # A
  v.position_grid = 64  # A
  v.max_pixels = 1792 * 1792  # A: 16,384 patches
  c.train.stages = ((8192, 1, 8192),)  # A: rows that hold the largest image's 4,096 tokens
  return c
