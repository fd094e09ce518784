"""A per-layer estimate of the activation bytes one device holds during a pass, from the config's widths.

Each layer kind is listed as the tensors it makes per token (`Act`): the width in elements, the bytes
an element takes, whether the tensor axis splits it (head and hidden widths; the routed experts run
whole on every tensor rank, inside the MoE's shard_map) and whether it is a matmul output. Under
`model.remat`:

* "none": every layer keeps all of its tensors for the backward pass;
* "dots": every layer keeps its matmul outputs (moejax.model.DOTS_POLICY);
* "full": every layer keeps only its input, and the backward pass recomputes one layer at a time,
  which then holds all of that layer's tensors (the transient).

The residual stream adds the AttnRes block sums, and for scanned layers the [N,B,T,D] block buffer the
scan carries, kept once per period (docs/performance.md, "model.scan_layers"). Chunked parts
(moe.token_chunk, ffn.token_chunk, kda.seq_chunk) are rematerialised piece by piece: they keep nothing
and hold one piece at a time. Not counted: the vision tower, XLA's temporary buffers and fragmentation.
"""

import collections
import dataclasses
import math

import jax.numpy as jnp

from moejax.layout import layer_kinds, layer_layout


@dataclasses.dataclass(frozen=True)
class Act:
  name: str
  width: float  # elements per token
  itemsize: int
  split: bool = False  # divided over the tensor axis
  matmul: bool = False  # a matmul output: what remat="dots" keeps
  chunk: str = ""  # computed in pieces of "moe", "ffn" or "kda" tokens, each rematerialised


def _residual(m, dt: int) -> list[Act]:
  """Per sublayer (mixer and FFN): the AttnRes mix (or residual sum), its RMSNorm, the new partial sum."""
  return [Act(f"{role} {what}", m.d_model, dt) for role in ("mixer", "ffn")
          for what in ("residual mix", "norm", "partial sum")]


def _kda(m, dt: int) -> list[Act]:
  k = m.kda
  H, K, V, R, C = k.num_heads, k.head_k_dim, k.head_v_dim, k.gate_rank, k.chunk_size
  mm = lambda name, width, split=True: Act(name, width, dt, split, True, "kda")
  el = lambda name, width, size=dt: Act(name, width, size, True, False, "kda")
  return [mm("q, k", 2 * H * K), mm("v", H * V), mm("beta", H), mm("decay rank", R, False),
          mm("decay", H * K), mm("gate rank", R, False), mm("gate", H * V), mm("out proj", m.d_model, False),
          el("short conv q, k, v", 2 * H * K + H * V), el("log decay (f32)", H * K, 4),
          # The chunked kernel's residuals (pallas_kernels/kda/ops.py): W, qg, kd; Vp; Aqk and the solve's
          # two [C] rows; the state entering each chunk, K x V per C tokens.
          el("kernel residuals", H * (3 * K + V + 3 * C + K * V / C)), el("output, gated", 2 * H * V)]


def _mla(m, dt: int) -> list[Act]:
  a = m.mla
  H, Q, C, K, V = a.num_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.v_head_dim
  mm = lambda name, width, split=True: Act(name, width, dt, split, True)
  el = lambda name, width, split=True, size=dt: Act(name, width, size, split)
  return [mm("q latent", Q, False), mm("q", H * K), mm("kv latent", C, False), mm("k", H * K), mm("v", H * V),
          mm("gate", H * V), mm("out proj", m.d_model, False), el("normed latents", Q + C, False),
          el("attention out, gated", 2 * H * V), el("softmax lse (f32)", H, True, 4)]


def _glu(name: str, hidden: int, d_model: int, dt: int) -> list[Act]:
  """A SiTU-GLU: its backward keeps only the gate and up activations (moejax/layers/ffn.py)."""
  return [Act(f"{name} gate, up", 2 * hidden, dt, True, True, "ffn"),
          Act(f"{name} down", d_model, dt, False, True, "ffn")]


def _moe(m, dt: int, expert_size: int) -> list[Act]:
  """The router, latent down/up and shared experts per token; per routed pair (top_k a token), the
  rows sent, and on the owner the capacity-padded receive buffer that the grouped matmuls run over
  (moejax/moe/expert_parallel.py: ceil(capacity_factor x rows), at most expert_size x rows)."""
  e = m.moe
  k, L, F = e.top_k, e.latent_dim, e.expert_hidden_dim
  padded = min(e.capacity_factor, expert_size) if expert_size > 1 else 1.0
  routed = lambda name, width, mm=False, size=dt: Act(name, k * width, size, False, mm, "moe")
  acts = [Act("router scores (f32)", e.num_experts, 4, matmul=True), Act("latent down", L, dt, matmul=True),
          routed("pairs sent and returned", 2 * L), routed("received rows", padded * L),
          routed("expert gate, up, down", padded * (2 * F + L), True),
          routed("expert activation", padded * F), Act("combined (f32), normed", L, 4 + dt, chunk="moe"),
          Act("latent up", m.d_model, dt, matmul=True)]
  for i in range(e.num_shared):
    acts += _glu(f"shared {i}", e.shared_hidden_dim, m.d_model, dt)
  return acts


def layer_acts(m, expert_size: int) -> list[tuple[int, list[Act]]]:
  """(how many layers, their tensors) for each kind of decoder layer."""
  dt = jnp.dtype(m.dtype).itemsize
  mixers = {"kda": _kda(m, dt), "mla": _mla(m, dt)}
  ffns = {"dense": _glu("ffn", m.ffn.hidden_dim, m.d_model, dt), "moe": _moe(m, dt, expert_size)}
  kinds = collections.Counter(layer_kinds(m))
  return [(n, _residual(m, dt) + mixers[mixer] + ffns[ffn]) for (mixer, ffn), n in kinds.items()]


@dataclasses.dataclass(frozen=True)
class Pass:
  """What one device runs in one pass: `rows` rows of `seq_len` tokens, with the tensor axis `tensor`."""
  rows: int
  seq_len: int
  tensor: int
  pass_tokens: int  # the whole pass's tokens, all devices (ffn.token_chunk divides those)

  @property
  def tokens(self) -> int:
    return self.rows * self.seq_len

  def pieces(self, m) -> dict[str, int]:
    """How many rematerialised pieces each chunked part takes (1: not chunked)."""
    sizes = {"moe": (m.moe.token_chunk, self.tokens), "ffn": (m.ffn.token_chunk, self.pass_tokens),
             "kda": (m.kda.seq_chunk, self.seq_len), "": (0, 1)}
    return {kind: total // size if size and total > size else 1 for kind, (size, total) in sizes.items()}


def _bytes(act: Act, step: Pass, pieces: dict[str, int]) -> float:
  """One tensor's bytes for the tokens it is computed over at once."""
  return step.tokens / pieces[act.chunk] * act.width * act.itemsize / (step.tensor if act.split else 1)


def _kept(remat: str, act: Act, pieces: dict[str, int]) -> bool:
  if pieces[act.chunk] > 1:
    return False
  return {"none": True, "dots": act.matmul, "full": False}[remat]


def residual_sources(m) -> tuple[int, int]:
  """(AttnRes sources at the end of the stack: the embedding and every block sum; the width in D of the
  block buffers a scan keeps, one per period)."""
  if m.attnres.mode != "attnres":
    return 1, 0
  bs, layout = m.attnres.block_size, layer_layout(m)
  blocks = 1 + math.ceil(2 * m.num_layers / bs)
  if not layout.repeats:
    return blocks, 0
  slots = 1 + 2 * layout.start // bs + layout.repeats * (2 * layout.period // bs)
  return blocks, layout.repeats * slots


def activation_bytes(m, step: Pass, expert_size: int, vocab_split: int) -> dict[str, float]:
  """Bytes one device holds for a pass, by part: kept (until the backward pass reaches the layer) and
  transient (the largest layer's forward and backward, the residual stream's gradient, the loss)."""
  layers, pieces, remat = layer_acts(m, expert_size), step.pieces(m), m.remat
  dt = jnp.dtype(m.dtype).itemsize
  kept = sum(n * _bytes(a, step, pieces) for n, acts in layers for a in acts if _kept(remat, a, pieces))
  blocks, scan_slots = residual_sources(m)
  row = step.tokens * m.d_model * dt
  recomputed = max(sum(_bytes(a, step, pieces) for a in acts) for _, acts in layers) if remat == "full" else 0
  loss_chunk = min(m.loss.chunk_tokens, step.seq_len) * step.rows * m.vocab_size / vocab_split
  return {
      "layer tensors kept": kept,
      "layer inputs kept (remat=full)": (m.num_layers if remat == "full" else 0) * row,
      "AttnRes blocks + scan buffers": (blocks + scan_slots) * row,
      "one layer recomputed (remat=full)": recomputed,
      "residual-stream gradients": (blocks + 1) * row,
      "loss chunk logits + grads (f32)": 2 * 4 * loss_chunk,
  }
