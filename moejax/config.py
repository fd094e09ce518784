"""The config schema: defaults for every field, and validation with clear errors.

Experiment files (`experiments/*.py`) start from `base_config()`, override what they need and
return it from `get_config()`. `validate()` runs before any model is built, so a bad config fails
with a message naming the field instead of a shape error deep inside a jitted function.
"""

import importlib.util
import pathlib

import ml_collections

from moejax.data.config import default_data_config, validate_data_config
from moejax.errors import ConfigError
from moejax.layout import layer_layout
from moejax.vision.config import default_image_data_config, default_vision_config, validate_vision

MIXERS = ("kda", "mla")
BALANCE_MODES = ("quantile", "sign", "aux", "none")
GROUPED_MATMULS = ("auto", "xla", "pallas", "interpret")
ROUTER_MATMULS = ("f32", "bf16x3", "auto")  # moejax.moe.router.router_scores
BALANCE_IMPLEMENTATIONS = ("auto", "xla", "pallas", "interpret")
MLA_ATTENTIONS = ("auto", "xla", "cudnn", "pallas", "interpret")
RESIDUAL_MODES = ("attnres", "residual")
KDA_IMPLEMENTATIONS = (None, "xla", "pallas", "interpret", "recurrent")
CONV_IMPLEMENTATIONS = ("xla", "pallas", "interpret")
NS_IMPLEMENTATIONS = ("auto", "xla", "pallas", "interpret")  # moejax.training.muon.newton_schulz


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.data = default_data_config()
  c.data.images = default_image_data_config()

  m = c.model = ml_collections.ConfigDict()
  # None: the tokenizer's, data.vocab_size (filled in by `validate`); or a larger size of its own, e.g.
  # padded to a multiple of 128 for the LM head's matmuls.
  m.vocab_size = ml_collections.FieldReference(None, field_type=int)
  m.d_model = 64
  m.num_layers = 4
  # One letter per layer, repeated to cover num_layers: K = KDA, M = gated MLA.
  m.layer_pattern = "KKKM"
  m.num_dense_layers = 1  # the first layers use a dense FFN, the rest the MoE FFN
  m.dtype = "float32"  # activation / matmul dtype
  m.param_dtype = "float32"
  m.norm_eps = 1e-6
  m.tie_embeddings = False  # the head is then the embedding's transpose over sqrt(d_model) (model.tied_head)
  # "none" | "dots" | "full": rematerialise nothing, all but the matmul outputs, or the whole of each
  # layer in the backward pass
  m.remat = "none"
  # Run the repeated layers as one scan (params stacked under "scanned"): compile time stops growing
  # with depth. See moejax.layout.layer_layout for which layers it covers.
  m.scan_layers = False

  k = m.kda = ml_collections.ConfigDict()
  k.num_heads = 4
  # Head widths; set to None to derive d_model // num_heads (which then must divide evenly).
  k.head_k_dim = ml_collections.FieldReference(16, field_type=int)
  k.head_v_dim = ml_collections.FieldReference(16, field_type=int)
  k.conv_size = 4
  k.gate_lower_bound = -5.0
  # "bounded": g = gate_lower_bound * sigmoid(...), the design. "unbounded": the original KDA gate
  # -exp(A_log) * softplus(...), for ablations; only implementation "recurrent" takes it.
  k.gate = "bounded"
  k.gate_rank = 16  # low-rank width of the decay-gate and output-gate projections
  # 32: the op's forward + backward is faster than at 64 on the H200 (BENCHMARKS.md, "KDA kernel").
  k.chunk_size = 32
  # Tokens per pass of the whole KDA layer over a row (0: the row at once). The recurrent state and
  # the conv history carry over between passes, each rematerialised; must divide T. For very long rows.
  k.seq_chunk = 0
  k.implementation = ml_collections.FieldReference(None, field_type=str)
  # The short convolution + SiLU, with q and k's l2 norm (pallas_kernels.short_conv): None picks its
  # Pallas kernels on GPU and XLA elsewhere; or "xla", "pallas", "interpret". On the H200 step the
  # kernels cut the KDA layers' projections and convolutions by a fifth (BENCHMARKS.md, "Short
  # convolution").
  k.conv_implementation = ml_collections.FieldReference(None, field_type=str)

  a = m.mla = ml_collections.ConfigDict()
  a.num_heads = 4
  a.q_lora_rank = 32
  a.kv_lora_rank = 16
  a.qk_nope_head_dim = ml_collections.FieldReference(16, field_type=int)
  a.v_head_dim = ml_collections.FieldReference(16, field_type=int)
  # 0: NoPE, the design (positions come from the KDA layers). R > 0 (even): R decoupled rotary dimensions
  # per head, for ablations (moejax.layers.mla).
  a.rope_head_dim = 0
  a.rope_theta = 10000.0
  # "auto": on GPU in 16-bit, the Pallas document-attention kernels for packed rows and cuDNN for rows of
  # one document (moejax.layers.mla.GatedMLA.implementation); XLA elsewhere. "interpret" runs the Pallas
  # kernels on the CPU.
  a.attention = "auto"

  r = m.attnres = ml_collections.ConfigDict()
  r.mode = "attnres"  # "attnres" | "residual" (plain pre-norm residual, for ablation)
  r.block_size = 4  # in sublayers: each mixer and each FFN is one sublayer

  f = m.ffn = ml_collections.ConfigDict()
  f.hidden_dim = 128  # dense SiTU-GLU width
  f.situ_b1 = 4.0
  f.situ_b2 = 25.0
  # Tokens per pass of the dense SiTU-GLUs (the dense layers' FFN and the MoE's shared experts; 0: all
  # at once), each pass rematerialised; must divide the tokens of a row batch. For very long rows.
  f.token_chunk = 0

  e = m.moe = ml_collections.ConfigDict()
  e.num_experts = 8
  e.top_k = 2
  e.num_shared = 1
  e.shared_hidden_dim = 64
  e.latent_dim = 32
  e.expert_hidden_dim = 32
  # docs/design.md §5 multiplies the routing weights p by this factor, but the latent RMSNorm that follows
  # removes any common factor of the weighted sum: it moves the output only through the norm's eps
  # (tests/test_moe.py). Kept for the formula's sake; it is not a knob for the routed branch's scale.
  e.routed_scaling = 1.0
  e.balance = "quantile"
  e.balance_iters = 4
  # The exact quantile sweeps (balance="quantile" on one token shard; where a mesh splits the tokens,
  # over data, fsdp or expert, the bias comes from a histogram in XLA across the shards and this option
  # is not used): "auto" (Pallas kernels on GPU, XLA elsewhere), "xla", "pallas" (GPU only) or
  # "interpret" (the kernels in Pallas interpret mode, slow; for tests). All give the same bias.
  e.balance_implementation = "auto"
  e.histogram_bins = 2048
  # Not causal, a diagnostic (benchmarks/balance.py --gpu): each training batch is routed with the bias
  # solved on that same batch, so what imbalance remains is the solver's and the bins', none of it the
  # bias lagging behind the router. Evaluation and generation route with the carried bias as usual.
  e.quantile_oracle = False
  # The bias that routes the next batch: this much of the current bias plus the rest of the one solved on
  # this batch (an exponential average of the solves). 0 takes the solve alone, which balances this
  # batch exactly and carries its content's quirks into the next; averaging trades them for a bias
  # that follows a moving router more slowly. Causal either way.
  e.quantile_smoothing = 0.0
  e.sign_rate = 1e-3  # one sign step per forward pass: per pass of train.microbatch_tokens
  e.aux_loss_weight = 1e-4
  # The routing bias's start on the first top_k experts (the others start at 0): 0 for real runs; a
  # positive value sends every token to the same experts until balancing moves the bias (with balance
  # "none" or "aux", which never move it, for good: the collapse that train.maxvio_alert must catch).
  e.initial_bias = 0.0
  # Expert parallelism only: each rank keeps at most capacity_factor x the mean load of the pairs sent
  # to its experts; both the padded CPU path and the ragged GPU path keep the same ones. Pairs past it
  # are dropped and counted in router/dropped; a factor >= the expert-axis size can never drop.
  e.capacity_factor = 2.0
  # Tokens per pass through the routed experts (0: all at once). Each pass is rematerialised, so only
  # one chunk's top_k routed rows are live: set it for long sequences (1m.py). Must divide the tokens
  # of each shard.
  e.token_chunk = 0
  # The experts' grouped matmuls: "auto" (Pallas kernel on GPU, jax.lax.ragged_dot elsewhere), "xla",
  # "pallas" (GPU only) or "interpret" (the Pallas kernels in interpret mode, slow; for tests).
  e.grouped_matmul = "auto"
  # The router's logits x W_r: "f32" (one float32 matmul at HIGHEST precision), "bf16x3" (the same
  # products on bf16 tensor cores, W_r as three exact bf16 parts; needs model.dtype bfloat16), or
  # "auto" (bf16x3 where the activations are bf16, else f32).
  e.router_matmul = "f32"

  m.vision = default_vision_config()

  lo = m.loss = ml_collections.ConfigDict()
  lo.z_loss_weight = 0.0
  lo.chunk_tokens = 2048  # the LM head runs over this many positions at a time

  o = c.optim = ml_collections.ConfigDict()
  o.name = "adamw"  # "adamw" | "muon" (Muon on matrices, AdamW on the rest)
  o.lr = 3e-3
  o.adam_lr = 3e-3  # AdamW part of "muon"
  o.warmup_steps = 20
  o.final_lr_fraction = 0.1
  o.b1 = 0.9
  o.b2 = 0.95
  o.eps = 1e-8
  o.weight_decay = 0.1
  o.grad_clip = 1.0  # global-norm clip; 0 disables
  o.muon_beta = 0.95
  o.muon_consistent_rms = 0.2
  # The Newton-Schulz iteration's dtype: bf16 as in the original Muon (tensor-core rate), or float32.
  o.muon_ns_dtype = "bfloat16"
  # Its symmetric products: "xla" (einsums), "pallas" (GPU kernels that compute each mirrored pair of tiles
  # once: moejax/training/muon.py) or "interpret" (those kernels on the CPU, slow: for tests). Under a mesh
  # the kernels split the experts over `expert` but iterate a matrix split over fsdp/tensor whole on each of
  # those devices, where "xla" shares its products out. "auto": "pallas" on a GPU unless the mesh splits
  # matrices over fsdp or tensor, else "xla" (moejax.training.muon.resolve_ns).
  o.muon_ns_implementation = "auto"
  o.qk_clip_tau = 0.0  # > 0 enables per-head QK-clip on MLA (reported MuonClip uses 100)

  t = c.train = ml_collections.ConfigDict()
  # Progressive context: (seq_len, steps, tokens per batch) per stage, run in order.
  t.stages = ((128, 200, 4096),)  # a tuple, so --config.train.stages="((128, 30, 2048),)" works
  # Gradient accumulation: each step's batch runs forward and backward in passes of at most this many
  # tokens (whole rows, at least one row a pass), and the optimizer updates once on their summed
  # gradients. 0: the whole batch in one pass. `passes_per_step` gives the count of a stage.
  t.microbatch_tokens = 0
  t.seed = 0  # parameter initialisation (the data order is data.seed)
  t.log_every = 10
  t.eval_every = 100
  t.eval_batches = 4
  t.checkpoint_every = 100
  t.keep_checkpoints = 3
  t.max_bad_steps = 5  # stop after this many consecutive non-finite steps
  # Seconds of training after which the run stops early, at the next step that logs (train.log_every),
  # saving a checkpoint there: the same command resumes it (a job's time limit, a benchmark split over
  # calls). Process 0's clock decides for every process. 0: no limit.
  t.time_limit_s = 0.0
  # False: each step computes the loss and folds its routing into the balance state as usual, and leaves
  # the parameters and the optimizer state as they are. A diagnostic: the load under a router that does
  # not move, so what imbalance remains is the batches' content, none of it the bias lagging behind the
  # router (benchmarks/balance.py --gpu, mode "frozen").
  t.update_params = True
  t.maxvio_alert = 1.0  # warn when MaxVio_batch stays above this ...
  t.maxvio_alert_steps = 50  # ... for this many consecutive steps
  t.progress_bar = True
  # Serve the run's metrics to Prometheus on this port of every process (moejax.training.prometheus,
  # deploy/prometheus); 0: no endpoint.
  t.metrics_port = 0
  # XLA may keep a value wider than the dtype the model rounds it to, and drops the f32 -> bf16 -> f32
  # round trips that the casts make (its default). Then a bf16 activation between two kernels is written
  # and read as float32, which adds traffic to every step (BENCHMARKS.md, "Step HBM traffic"; static,
  # not timed). Off, every cast is honoured, on the GPU as on the CPU.
  t.allow_excess_precision = False
  # The GPU compiler's choices for the train and eval steps (no effect on other backends). True leaves
  # XLA's default (or the XLA_FLAGS of the process). xla_triton_gemm=False hands every dense matmul to
  # cuBLAS instead of autotuning XLA's own Triton GEMMs for each, whose compiles kept the H200 step
  # compiling for minutes. xla_dot_merger=False stops XLA from merging matmuls that share an operand
  # (x W_a and x W_b as x [W_a | W_b]): in the H200 step the merged outputs are sliced and their
  # gradients concatenated, more traffic than unmerged (BENCHMARKS.md, "Step HBM traffic"; not timed).
  t.xla_triton_gemm = True
  t.xla_dot_merger = True
  # Device mesh of the run (moejax.parallel.mesh): rows split over data x fsdp x expert, routed
  # experts over expert, params by their logical axes. All ones: one device.
  t.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "expert": 1, "tensor": 1})

  g = c.inference = ml_collections.ConfigDict()  # moejax.inference: generation from a checkpoint
  # Positions a decode cache holds per row (prompt, every turn of a conversation, and the new tokens).
  # 0: the longest sequence the run trains on (the last of train.stages' lengths). The KDA state has no
  # length; the MLA latents take cache_len x kv_lora_rank numbers a row.
  g.cache_len = 0
  # Longer prompts are prefilled in pieces of this many tokens (a power of two), one after another into
  # the cache: the activations of one piece are live at a time.
  g.prefill_chunk = 8192
  return c


def passes_per_step(seq_len: int, tokens: int, microbatch_tokens: int) -> int:
  """How many forward/backward passes a step of `tokens` tokens in rows of `seq_len` takes under
  train.microbatch_tokens: each pass takes the most whole rows that fit `microbatch_tokens`, and at
  least one (0: the whole batch at once). Raises ConfigError when those passes cannot be equal."""
  rows = tokens // seq_len
  if not microbatch_tokens:
    return 1
  per_pass = max(1, min(rows, microbatch_tokens // seq_len))
  if rows % per_pass:
    raise ConfigError(f"train.microbatch_tokens={microbatch_tokens} takes {per_pass} rows of {seq_len} a "
                      f"pass, which does not divide the {rows} rows of a {tokens}-token batch")
  return rows // per_pass


def load_experiment(path) -> ml_collections.ConfigDict:
  """`get_config()` of an experiment file (experiments/*.py), as config_flags loads it; not validated."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no experiment config file at {path}")
  spec = importlib.util.spec_from_file_location(f"moejax_experiment_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Raises ConfigError naming the offending field; fills derived head widths in place.

  Returns the config for chaining.
  """
  m = config.model

  def need(cond, msg):
    if not cond:
      raise ConfigError(msg)

  if m.vocab_size is None:
    m.vocab_size = int(config.data.vocab_size)
  need(int(m.vocab_size) >= int(config.data.vocab_size),
       f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's data.vocab_size="
       f"{config.data.vocab_size}")
  for name in ("vocab_size", "d_model", "num_layers"):
    need(int(m[name]) > 0, f"model.{name} must be positive, got {m[name]}")
  need(m.dtype in ("float32", "bfloat16", "float16"), f"model.dtype {m.dtype!r} is not a float dtype")
  need(m.param_dtype in ("float32", "bfloat16"), f"model.param_dtype {m.param_dtype!r} unsupported")
  need(m.remat in ("none", "dots", "full"), f"model.remat must be 'none', 'dots' or 'full', got {m.remat!r}")
  need(isinstance(m.scan_layers, bool), f"model.scan_layers must be True or False, got {m.scan_layers!r}")

  pattern = m.layer_pattern
  need(len(pattern) > 0 and set(pattern) <= {"K", "M"},
       f"model.layer_pattern {pattern!r} must be a non-empty string of 'K' (KDA) and 'M' (MLA)")
  need(m.num_layers % len(pattern) == 0,
       f"model.layer_pattern {pattern!r} (length {len(pattern)}) does not fit "
       f"model.num_layers={m.num_layers}: the layer count must be a multiple of the pattern length")
  need(0 <= m.num_dense_layers <= m.num_layers,
       f"model.num_dense_layers={m.num_dense_layers} must be in [0, num_layers={m.num_layers}]")

  for name, heads, dims in (("kda", m.kda.num_heads, ("head_k_dim", "head_v_dim")),
                            ("mla", m.mla.num_heads, ("qk_nope_head_dim", "v_head_dim"))):
    need(heads > 0, f"model.{name}.num_heads must be positive, got {heads}")
    for dim in dims:
      if m[name][dim] is None:
        need(m.d_model % heads == 0,
             f"model.{name}.num_heads={heads} does not divide model.d_model={m.d_model}, so "
             f"model.{name}.{dim} cannot be derived: set it explicitly or change the head count")
        m[name][dim] = m.d_model // heads
      need(m[name][dim] > 0, f"model.{name}.{dim} must be positive, got {m[name][dim]}")

  k = m.kda
  lb = float(k.gate_lower_bound)
  need(-5.0 <= lb < 0.0,
       f"model.kda.gate_lower_bound={lb} must lie in [-5, 0): below -5 the 16-token tile exponent "
       f"exceeds fp32 range (5*15=75 < 88.7), and 0 would freeze the state")
  need(k.gate in ("bounded", "unbounded"), f"model.kda.gate={k.gate!r} must be 'bounded' or 'unbounded'")
  need(k.gate == "bounded" or k.implementation == "recurrent",
       "model.kda.gate='unbounded' needs model.kda.implementation='recurrent': the chunked forms (XLA and "
       "the kernels) factor each tile's decays, which only the bound keeps within float32")
  need(k.head_k_dim <= 256 and k.head_v_dim <= 256, "model.kda head dims must be <= 256")
  need(k.chunk_size % 16 == 0 and k.chunk_size > 0,
       f"model.kda.chunk_size={k.chunk_size} must be a positive multiple of the 16-token tile")
  need(k.implementation in KDA_IMPLEMENTATIONS,
       f"model.kda.implementation={k.implementation!r} not in {KDA_IMPLEMENTATIONS}")
  if k.implementation in (None, "pallas", "interpret"):  # None: the Pallas kernel on GPU
    # Imported here: the package pulls in JAX and the kernels, which importing moejax.config (as the
    # data pipeline does) should not.
    from pallas_kernels.kda import limits as kda_limits

    why = kda_limits.unsupported(k.chunk_size, k.head_k_dim, k.head_v_dim)
    need(why is None, f"model.kda (chunk_size={k.chunk_size}, head dims {k.head_k_dim}/{k.head_v_dim}, "
                      f"implementation {k.implementation!r}): {why}; set model.kda.implementation='xla' for "
                      "other shapes")
  need(k.conv_implementation is None or k.conv_implementation in CONV_IMPLEMENTATIONS,
       f"model.kda.conv_implementation={k.conv_implementation!r} not in {CONV_IMPLEMENTATIONS} or None")
  if k.conv_implementation != "xla":  # None: the Pallas kernels on GPU, which normalise q and k per head
    need(k.head_k_dim & (k.head_k_dim - 1) == 0,
         f"model.kda.head_k_dim={k.head_k_dim}: the Pallas short-convolution kernels normalise q and k over "
         f"power-of-two heads; set model.kda.conv_implementation='xla' for other widths")
  need(k.conv_size >= 1, "model.kda.conv_size must be >= 1")
  need(isinstance(k.seq_chunk, int) and k.seq_chunk >= 0 and k.seq_chunk % k.chunk_size == 0
       and (k.seq_chunk == 0 or k.seq_chunk >= k.conv_size),
       f"model.kda.seq_chunk={k.seq_chunk!r} must be 0 (off) or a positive multiple of "
       f"model.kda.chunk_size={k.chunk_size}")

  need(isinstance(m.mla.rope_head_dim, int) and m.mla.rope_head_dim >= 0 and m.mla.rope_head_dim % 2 == 0,
       f"model.mla.rope_head_dim={m.mla.rope_head_dim!r} must be an even integer >= 0 (0: NoPE)")
  need(float(m.mla.rope_theta) > 0, f"model.mla.rope_theta={m.mla.rope_theta} must be positive")
  need(m.mla.attention in MLA_ATTENTIONS, f"model.mla.attention={m.mla.attention!r} not in {MLA_ATTENTIONS}")
  r = m.attnres
  need(r.mode in RESIDUAL_MODES, f"model.attnres.mode={r.mode!r} not in {RESIDUAL_MODES}")
  need(r.block_size >= 1, f"model.attnres.block_size={r.block_size} must be >= 1")

  if m.scan_layers:
    layout = layer_layout(m)
    need(layout.repeats >= 1,
         f"model.scan_layers: no run of two identical layer periods to scan in model.num_layers="
         f"{m.num_layers} (with AttnRes a period is a whole number of blocks, model.attnres.block_size="
         f"{r.block_size} sublayers, starting on a block boundary after layer 0); set scan_layers=False")

  f = m.ffn
  need(f.situ_b1 > 0 and f.situ_b2 > 0, "model.ffn.situ_b1 and situ_b2 must be positive")
  need(isinstance(f.token_chunk, int) and f.token_chunk >= 0,
       f"model.ffn.token_chunk must be an integer >= 0 (0: no chunking), got {f.token_chunk!r}")

  e = m.moe
  if m.num_dense_layers < m.num_layers:
    need(e.num_experts >= 1, "model.moe.num_experts must be >= 1")
    need(2 <= e.top_k <= e.num_experts,
         f"model.moe.top_k={e.top_k} must be in [2, num_experts={e.num_experts}]: the routing weights "
         f"are the chosen scores normalised over the top k, which at k=1 is the constant routed_scaling, "
         f"so the router would get no gradient from the loss")
    need(e.routed_scaling > 0, f"model.moe.routed_scaling={e.routed_scaling} must be positive")
    need(e.capacity_factor > 0,
         f"model.moe.capacity_factor={e.capacity_factor} must be positive (expert parallelism's buffers)")
    need(isinstance(e.histogram_bins, int) and e.histogram_bins >= 2,
         f"model.moe.histogram_bins must be an integer >= 2, got {e.histogram_bins!r}")
    need(float(e.initial_bias) >= 0, f"model.moe.initial_bias={e.initial_bias} must be >= 0")
    need(e.sign_rate > 0 and e.aux_loss_weight >= 0 and e.balance_iters >= 1,
         "model.moe.sign_rate must be positive, aux_loss_weight >= 0 and balance_iters >= 1")
    need(e.balance in BALANCE_MODES, f"model.moe.balance={e.balance!r} not in {BALANCE_MODES}")
    need(not e.quantile_oracle or e.balance == "quantile",
         f"model.moe.quantile_oracle routes with the quantile bias: it needs balance='quantile', not "
         f"{e.balance!r}")
    smoothing = e.quantile_smoothing
    need(isinstance(smoothing, int | float) and not isinstance(smoothing, bool) and 0 <= smoothing < 1,
         f"model.moe.quantile_smoothing must be a number in [0, 1), got {smoothing!r}")
    need(not smoothing or (e.balance == "quantile" and not e.quantile_oracle),
         f"model.moe.quantile_smoothing={smoothing} averages the causal quantile bias: it needs "
         f"balance='quantile' without quantile_oracle")
    need(e.grouped_matmul in GROUPED_MATMULS,
         f"model.moe.grouped_matmul={e.grouped_matmul!r} not in {GROUPED_MATMULS}")
    need(e.balance_implementation in BALANCE_IMPLEMENTATIONS,
         f"model.moe.balance_implementation={e.balance_implementation!r} not in {BALANCE_IMPLEMENTATIONS}")
    need(e.router_matmul in ROUTER_MATMULS,
         f"model.moe.router_matmul={e.router_matmul!r} not in {ROUTER_MATMULS}")
    need(e.router_matmul != "bf16x3" or m.dtype == "bfloat16",
         f"model.moe.router_matmul='bf16x3' needs model.dtype='bfloat16' (got {m.dtype!r})")
    need(e.num_shared >= 0, "model.moe.num_shared must be >= 0")
    need(isinstance(e.token_chunk, int) and e.token_chunk >= 0,
         f"model.moe.token_chunk must be an integer >= 0 (0: no chunking), got {e.token_chunk!r}")
    need(e.latent_dim > 0 and e.expert_hidden_dim > 0, "model.moe latent/expert dims must be positive")
  validate_data_config(config.data)
  validate_vision(config)

  o = config.optim
  need(o.name in ("adamw", "muon"), f"optim.name={o.name!r} must be 'adamw' or 'muon'")
  need(o.lr > 0 and o.adam_lr > 0, "optim.lr and optim.adam_lr must be positive")
  need(o.warmup_steps >= 0 and o.grad_clip >= 0 and o.qk_clip_tau >= 0,
       "optim.warmup_steps, grad_clip and qk_clip_tau must be >= 0")
  need(0.0 <= o.final_lr_fraction <= 1.0,
       f"optim.final_lr_fraction={o.final_lr_fraction} must be in [0, 1] (of optim.lr, at the last step)")
  need(isinstance(m.loss.chunk_tokens, int) and m.loss.chunk_tokens >= 1,
       f"model.loss.chunk_tokens must be an integer >= 1, got {m.loss.chunk_tokens!r}")
  need(o.muon_ns_dtype in ("bfloat16", "float32"),
       f"optim.muon_ns_dtype={o.muon_ns_dtype!r} must be 'bfloat16' or 'float32'")
  need(o.muon_ns_implementation in NS_IMPLEMENTATIONS,
       f"optim.muon_ns_implementation={o.muon_ns_implementation!r} not in {NS_IMPLEMENTATIONS}")

  t = config.train
  need(len(t.stages) > 0, "train.stages must list at least one (seq_len, steps, tokens_per_batch)")
  for i, stage in enumerate(t.stages):
    need(isinstance(stage, (tuple, list)) and len(stage) == 3,
         f"train.stages[{i}]={stage!r} must be (seq_len, steps, tokens_per_batch): train.stages is a "
         f"tuple of such triples, e.g. ((128, 30, 2048),)")
    need(all(isinstance(v, int) and not isinstance(v, bool) for v in stage),
         f"train.stages[{i}]={stage!r}: seq_len, steps and tokens_per_batch must be integers")
    seq_len, steps, tokens = stage
    need(seq_len >= 2 and steps >= 1 and tokens >= seq_len,
         f"train.stages[{i}]={stage!r}: need seq_len >= 2, steps >= 1, tokens_per_batch >= seq_len")
    need(tokens % seq_len == 0,
         f"train.stages[{i}]: tokens_per_batch={tokens} is not a multiple of seq_len={seq_len}")
  need(t.max_bad_steps >= 1, "train.max_bad_steps must be >= 1")
  limit = t.time_limit_s
  need(isinstance(limit, int | float) and not isinstance(limit, bool) and limit >= 0,
       f"train.time_limit_s must be a number of seconds >= 0 (0: no limit), got {t.time_limit_s!r}")
  for name in ("log_every", "checkpoint_every", "keep_checkpoints", "maxvio_alert_steps"):
    need(isinstance(t[name], int) and t[name] >= 1, f"train.{name} must be an integer >= 1, got {t[name]!r}")
  need(isinstance(t.eval_every, int) and t.eval_every >= 0,
       f"train.eval_every must be an integer >= 0 (0: no evaluation), got {t.eval_every!r}")
  if t.eval_every:
    need(isinstance(t.eval_batches, int) and t.eval_batches >= 1,
         f"train.eval_batches must be an integer >= 1 while train.eval_every={t.eval_every}, got "
         f"{t.eval_batches!r}")
    need(float(config.data.valid_fraction) > 0,
         f"train.eval_every={t.eval_every} evaluates on the validation split, but data.valid_fraction=0 "
         "leaves it empty: set data.valid_fraction > 0 or train.eval_every = 0")
  need(isinstance(t.seed, int) and 0 <= t.seed < 2**32, f"train.seed={t.seed!r} must be in [0, 2**32)")
  # Stage i's train stream is shuffled with data.seed + i (moejax.train).
  need(int(config.data.seed) + len(t.stages) - 1 < 2**32,
       f"data.seed={config.data.seed}: stage i shuffles with data.seed + i, which must stay below 2**32 "
       f"for all {len(t.stages)} stages")
  for name in ("allow_excess_precision", "xla_triton_gemm", "xla_dot_merger"):
    need(isinstance(t[name], bool), f"train.{name} must be True or False, got {t[name]!r}")
  need(type(t.metrics_port) is int and 0 <= t.metrics_port < 65536,
       f"train.metrics_port must be a TCP port in [1, 65535], or 0 for no endpoint; got {t.metrics_port!r}")
  need(set(t.mesh) == {"data", "fsdp", "expert", "tensor"},
       f"train.mesh must have exactly the axes data, fsdp, expert, tensor; got {sorted(t.mesh)}")
  need(all(isinstance(n, int) and n >= 1 for n in t.mesh.values()),
       f"train.mesh sizes must be positive integers, got {dict(t.mesh)}")
  need(isinstance(t.microbatch_tokens, int) and not isinstance(t.microbatch_tokens, bool)
       and t.microbatch_tokens >= 0,
       f"train.microbatch_tokens must be an integer >= 0 (0: one pass a step), got {t.microbatch_tokens!r}")
  row_shards = t.mesh.data * t.mesh.fsdp * t.mesh.expert
  for i, (seq_len, _, stage_tokens) in enumerate(t.stages):
    try:
      passes = passes_per_step(seq_len, stage_tokens, t.microbatch_tokens)
    except ConfigError as e:
      raise ConfigError(f"train.stages[{i}]: {e}") from None
    # What one pass holds: the layers see a pass, never the whole batch at once.
    tokens = stage_tokens // passes
    need((tokens // seq_len) % row_shards == 0,
         f"train.stages[{i}] has {tokens // seq_len} rows per pass, not divisible by the "
         f"{row_shards} row shards of train.mesh (data x fsdp x expert)")
    # The chunked layers refuse a chunk that does not divide what they split, but only when the stage's
    # step first compiles, which for a late stage is hours into the run.
    for field, chunk, total, what in (
        ("model.kda.seq_chunk", m.kda.seq_chunk, seq_len, "row length"),
        ("model.ffn.token_chunk", m.ffn.token_chunk, tokens, "tokens per pass"),
        ("model.moe.token_chunk", m.moe.token_chunk if m.num_dense_layers < m.num_layers else 0,
         tokens // row_shards, "tokens per row shard of a pass")):
      need(not chunk or total <= chunk or total % chunk == 0,
           f"{field}={chunk} does not divide train.stages[{i}]'s {what}, {total}")
  g = config.inference
  need(isinstance(g.cache_len, int) and g.cache_len >= 0,
       f"inference.cache_len must be an integer >= 0 (0: the longest train stage), got {g.cache_len!r}")
  need(isinstance(g.prefill_chunk, int) and g.prefill_chunk >= 16
       and g.prefill_chunk & (g.prefill_chunk - 1) == 0,
       f"inference.prefill_chunk must be a power of two >= 16, got {g.prefill_chunk!r}")
  if m.num_dense_layers < m.num_layers:
    need(m.moe.num_experts % t.mesh.expert == 0,
         f"model.moe.num_experts={m.moe.num_experts} is not divisible by train.mesh.expert={t.mesh.expert}")
  return config
