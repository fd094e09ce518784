"""The vision tower: native-resolution patches of many images packed into one row -> decoder tokens.

    patches [B,N,p*p*3] uint8 -> patch embedding + interpolated position table -> depth x ViT block
    (pre-LayerNorm; attention with 2D RoPE, bidirectional inside each image and blind across images;
    GELU MLP) -> LayerNorm -> merge x merge neighbouring patches concatenated -> MLP projector -> [B,N/m^2,D]

Images are told apart by `image_ids` (1, 2, ... per image in a row, 0 on padding patches): the attention
is the non-causal mode of the packed-document kernel (pallas_kernels.attention), so a row of many small
images costs the sum of their squares, not the square of their sum. Patches come merge block by merge
block (moejax.vision.patches), so merging is a reshape.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moejax.nn import LAYERS_AXIS, Dense, logical_param
from moejax.vision.positions import interpolated_positions, rope_2d
from pallas_kernels.attention import document_attention

# The table's initial scale, against patch embeddings of about unit scale: at 0.02 (a token embedding's
# usual) the tiny recipe learnt colours, counts and shapes but placed objects at chance, its absolute
# position signal too faint beside the pixels'.
POSITION_INIT_STD = 1.0


def attention_implementation(choice: str, dtype) -> str:
  """"auto": the Pallas kernels on a GPU in 16-bit, the dense XLA reference elsewhere."""
  if choice != "auto":
    return choice
  narrow = jnp.dtype(dtype).itemsize == 2
  return "pallas" if jax.default_backend() == "gpu" and narrow else "xla"


class LayerNorm(nn.Module):
  """LayerNorm in float32 with a learned scale and bias (logical axis "norm")."""

  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    width = x.shape[-1]
    scale = logical_param(self, "scale", nn.initializers.ones, (width,), ("norm",), self.param_dtype)
    bias = logical_param(self, "bias", nn.initializers.zeros, (width,), ("norm",), self.param_dtype)
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


class VisionBlock(nn.Module):
  """Pre-norm ViT block over packed images: (x [B,N,W], image_ids [B,N], coords [B,N,4]) -> x."""

  cfg: ml_collections.FrozenConfigDict  # model.vision
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x_BNW, image_ids_BN, coords_BN4):
    v = self.cfg
    H, K = v.num_heads, v.width // v.num_heads
    dense = lambda features, axes, name: Dense(features, axes, use_bias=True, dtype=self.dtype,
                                               param_dtype=self.param_dtype, name=name)
    h = LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="attention_norm")(x_BNW)
    q, k, val = (dense((H, K), ("embed", "heads", "kv"), name)(h) for name in ("query", "key", "value"))
    B, N = image_ids_BN.shape
    rope = lambda t: jax.vmap(rope_2d, in_axes=(0, 0, 0, None))(t, coords_BN4[..., 0], coords_BN4[..., 1],
                                                                v.rope_theta)
    o_BNHK = document_attention(rope(q), rope(k), val, image_ids_BN, scale=K ** -0.5, causal=False,
                                implementation=attention_implementation(v.attention, self.dtype))
    x_BNW = x_BNW + dense(v.width, ("heads", "embed"), "output")(o_BNHK.reshape(B, N, H * K))
    h = LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="mlp_norm")(x_BNW)
    h = nn.gelu(dense(v.mlp_dim, ("embed", "mlp"), "mlp_in")(h), approximate=True)
    return x_BNW + dense(v.width, ("mlp", "embed"), "mlp_out")(h)


class _ScannedBlock(nn.Module):
  cfg: ml_collections.FrozenConfigDict
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x_BNW, image_ids_BN, coords_BN4):
    return VisionBlock(self.cfg, self.dtype, self.param_dtype, name="block")(x_BNW, image_ids_BN,
                                                                             coords_BN4), None


class VisionEncoder(nn.Module):
  """(patches uint8 [B,N,p*p*3], image_ids int [B,N], coords int [B,N,4]) -> tokens [B, N/merge^2, d_model].

  N must be a multiple of merge^2, and each image's patches a whole number of merge blocks, as
  `moejax.vision.patches.patchify` lists them."""

  cfg: ml_collections.FrozenConfigDict  # model.vision
  d_model: int
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  remat: bool = False
  scan: bool = False

  @nn.compact
  def __call__(self, patches_BNP, image_ids_BN, coords_BN4):
    v = self.cfg
    B, N, P = patches_BNP.shape
    group = v.merge * v.merge
    if P != v.patch_size * v.patch_size * 3:
      raise ValueError(f"patches of {P} values, expected {v.patch_size}x{v.patch_size}x3")
    if N % group or image_ids_BN.shape != (B, N) or coords_BN4.shape != (B, N, 4):
      raise ValueError(f"want N a multiple of {group}, image_ids [B,N] and coords [B,N,4]; got patches "
                       f"{patches_BNP.shape}, ids {image_ids_BN.shape}, coords {coords_BN4.shape}")
    pixels = patches_BNP.astype(jnp.float32) / 127.5 - 1.0
    x_BNW = Dense(v.width, ("conv", "embed"), use_bias=True, dtype=self.dtype, param_dtype=self.param_dtype,
                  name="patch_embedding")(pixels.astype(self.dtype))
    table = logical_param(self, "position_table", nn.initializers.normal(POSITION_INIT_STD),
                          (v.position_grid, v.position_grid, v.width), ("grid", "grid", "embed"),
                          self.param_dtype)
    positions = interpolated_positions(table, coords_BN4.reshape(B * N, 4)).reshape(B, N, v.width)
    x_BNW = x_BNW + positions.astype(self.dtype)
    block = nn.remat(VisionBlock) if self.remat else VisionBlock
    if self.scan:
      body = nn.remat(_ScannedBlock) if self.remat else _ScannedBlock
      blocks = nn.scan(body, variable_axes={True: 0}, split_rngs={"params": True},
                       in_axes=(nn.broadcast, nn.broadcast), length=v.depth,
                       metadata_params={nn.PARTITION_NAME: LAYERS_AXIS})
      x_BNW, _ = blocks(v, self.dtype, self.param_dtype, name="blocks")(x_BNW, image_ids_BN, coords_BN4)
    else:
      for i in range(v.depth):
        x_BNW = block(v, self.dtype, self.param_dtype, name=f"block_{i}")(x_BNW, image_ids_BN, coords_BN4)
    x_BNW = LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="final_norm")(x_BNW)
    merged = x_BNW.reshape(B, N // group, group * v.width)
    merged = LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="projector_norm")(merged)
    hidden = v.projector_dim or self.d_model
    h = nn.gelu(Dense(hidden, ("embed", "mlp"), use_bias=True, dtype=self.dtype, param_dtype=self.param_dtype,
                      name="projector_in")(merged), approximate=True)
    return Dense(self.d_model, ("mlp", "embed"), use_bias=True, dtype=self.dtype,
                 param_dtype=self.param_dtype, name="projector_out")(h)


def place_images(x_BTD, tokens_BT, image_tokens_BMD, image_id: int):
  """The row embeddings with the k-th image placeholder of each row (tokens == image_id) replaced by
  that row's k-th image token. A row's placeholders must not outnumber its image tokens (M); the data
  pipeline and `generate` expand each image's placeholder to exactly its token count."""
  is_image = tokens_BT == image_id
  index_BT = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, image_tokens_BMD.shape[1] - 1)
  picked_BTD = jnp.take_along_axis(image_tokens_BMD, index_BT[..., None], axis=1)
  return jnp.where(is_image[..., None], picked_BTD.astype(x_BTD.dtype), x_BTD)
