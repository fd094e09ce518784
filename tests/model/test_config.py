"""Config validation gives clear errors naming the field; experiment files load."""

import pathlib

import pytest

from moejax.config import base_config, load_experiment, passes_per_step, validate
from moejax.errors import ConfigError

EXPERIMENTS = sorted(pathlib.Path(__file__).resolve().parents[2].glob("experiments/*.py"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_configs_validate(path):
  validate(load_experiment(path))


def _with(**overrides):
  c = base_config()
  for dotted, value in overrides.items():
    node = c
    *parents, leaf = dotted.split("__")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


@pytest.mark.parametrize("overrides, message", [
    (dict(model__kda__gate_lower_bound=-5.5), r"gate_lower_bound=-5.5 must lie in \[-5, 0\)"),
    (dict(model__kda__gate_lower_bound=0.0), r"gate_lower_bound=0.0 must lie in \[-5, 0\)"),
    (dict(model__layer_pattern="KKKM", model__num_layers=6), r"does not fit model.num_layers=6"),
    (dict(model__layer_pattern="KXM"), r"string of 'K' \(KDA\) and 'M' \(MLA\)"),
    (dict(model__kda__num_heads=5, model__kda__head_k_dim=None),
     r"model.kda.num_heads=5 does not divide model.d_model=64"),
    (dict(model__mla__num_heads=3, model__mla__v_head_dim=None),
     r"model.mla.num_heads=3 does not divide model.d_model=64"),
    (dict(model__kda__chunk_size=24), r"chunk_size=24 must be a positive multiple of the 16-token tile"),
    (dict(model__kda__chunk_size=48), r"chunk_size=48, .*the Pallas KDA kernel needs chunk_size in"),
    (dict(model__kda__chunk_size=128, model__kda__head_k_dim=256),
     r"chunk_size=128, head dims 256/.*at chunk_size 128 supports K and V up to 128"),
    (dict(model__kda__implementation="xla", model__kda__head_k_dim=24),
     r"head_k_dim=24: the Pallas short-convolution kernels normalise q and k over power-of-two heads"),
    (dict(model__kda__conv_implementation="cuda"), r"conv_implementation='cuda' not in"),
    (dict(model__moe__top_k=9), r"top_k=9 must be in \[2, num_experts=8\]"),
    (dict(model__moe__top_k=1), r"top_k=1 must be in \[2, .*so the router would get no gradient"),
    (dict(model__moe__capacity_factor=0.0), r"model.moe.capacity_factor=0.0 must be positive"),
    (dict(model__moe__routed_scaling=0.0), r"model.moe.routed_scaling=0.0 must be positive"),
    (dict(model__moe__histogram_bins=1), r"model.moe.histogram_bins must be an integer >= 2"),
    (dict(model__moe__balance_iters=0), r"balance_iters >= 1"),
    (dict(model__moe__quantile_smoothing=1.0), r"quantile_smoothing must be a number in \[0, 1\), got 1.0"),
    (dict(model__moe__quantile_smoothing=0.5, model__moe__balance="sign"),
     r"quantile_smoothing=0.5 averages the causal quantile bias: it needs balance='quantile'"),
    (dict(model__moe__quantile_smoothing=0.5, model__moe__quantile_oracle=True), r"without quantile_oracle"),
    (dict(model__moe__balance="magic"), r"balance='magic' not in"),
    (dict(model__moe__grouped_matmul="triton"), r"grouped_matmul='triton' not in"),
    (dict(model__moe__router_matmul="tf32"), r"router_matmul='tf32' not in \('f32', 'bf16x3', 'auto'\)"),
    (dict(model__moe__router_matmul="bf16x3", model__dtype="float32"),
     r"router_matmul='bf16x3' needs model.dtype='bfloat16'"),
    (dict(model__moe__balance_implementation="cuda"),
     r"model.moe.balance_implementation='cuda' not in \('auto', 'xla', 'pallas', 'interpret'\)"),
    (dict(model__mla__attention="flash"), r"mla.attention='flash' not in"),
    (dict(model__attnres__mode="sum"), r"attnres.mode='sum'"),
    (dict(model__num_dense_layers=9), r"num_dense_layers=9"),
    (dict(train__stages=[(128, 10, 1000)]), r"not a multiple of seq_len=128"),
    (dict(train__stages=[]), r"at least one"),
    (dict(train__stages=(128, 3, 1024)), r"train.stages\[0\]=128 must be \(seq_len, steps, tokens_"),
    (dict(optim__name="sgd"), r"optim.name='sgd'"),
    (dict(train__allow_excess_precision=None), r"train.allow_excess_precision must be True or False"),
    (dict(train__xla_dot_merger=None), r"train.xla_dot_merger must be True or False, got None"),
    (dict(train__checkpoint_every=0), r"train.checkpoint_every must be an integer >= 1, got 0"),
    (dict(train__log_every=0), r"train.log_every must be an integer >= 1"),
    (dict(train__keep_checkpoints=0), r"train.keep_checkpoints must be an integer >= 1"),
    (dict(train__maxvio_alert_steps=0), r"train.maxvio_alert_steps must be an integer >= 1"),
    (dict(train__eval_every=-1), r"train.eval_every must be an integer >= 0"),
    (dict(train__eval_batches=0), r"train.eval_batches must be an integer >= 1 while train.eval_every=100"),
    (dict(data__valid_fraction=0.0), r"data.valid_fraction=0 leaves it empty"),
    (dict(train__seed=-1), r"train.seed=-1 must be in \[0, 2\*\*32\)"),
    (dict(data__seed=2**32 - 1, train__stages=((128, 3, 1024), (256, 3, 1024))),
     r"data.seed=4294967295: stage i shuffles with data.seed \+ i"),
    (dict(train__stages=((128.0, 3, 1024),)), r"must be integers"),
    (dict(optim__final_lr_fraction=-0.1), r"optim.final_lr_fraction=-0.1 must be in \[0, 1\]"),
    (dict(model__loss__chunk_tokens=0), r"model.loss.chunk_tokens must be an integer >= 1"),
    (dict(model__kda__seq_chunk=96, train__stages=((128, 3, 1024), (192, 3, 1536))),
     r"model.kda.seq_chunk=96 does not divide train.stages\[0\]'s row length, 128"),
    (dict(model__ffn__token_chunk=768, train__stages=((128, 3, 1024), (256, 3, 1536))),
     r"model.ffn.token_chunk=768 does not divide train.stages\[0\]'s tokens per pass, 1024"),
    (dict(model__moe__token_chunk=384, train__mesh=dict(data=2, fsdp=1, expert=1, tensor=1)),
     r"model.moe.token_chunk=384 does not divide train.stages\[0\]'s tokens per row shard of a pass, 2048"),
    (dict(train__microbatch_tokens=-1), r"train.microbatch_tokens must be an integer >= 0"),
    (dict(train__microbatch_tokens=512, train__stages=((128, 3, 1280),)),
     r"train.stages\[0\]: train.microbatch_tokens=512 takes 4 rows of 128 a pass, which does not divide "
     r"the 10 rows"),
    (dict(train__microbatch_tokens=128, train__mesh=dict(data=2, fsdp=1, expert=1, tensor=1)),
     r"train.stages\[0\] has 1 rows per pass, not divisible by the 2 row shards"),
])
def test_bad_configs_fail_clearly(overrides, message):
  with pytest.raises(ConfigError, match=message):
    validate(_with(**overrides))


@pytest.mark.parametrize("seq_len, tokens, microbatch_tokens, passes", [
    (8192, 131072, 32768, 4),  # experiments/h200.py
    (8192, 131072, 40000, 4),  # the most whole rows that fit: 4
    (8192, 131072, 0, 1),      # 0: one pass
    (8192, 32768, 65536, 1),   # more than the batch: one pass
    (1048576, 1048576, 32768, 1),  # rows longer than a pass: one row a pass
    (65536, 524288, 32768, 8),
])
def test_passes_per_step(seq_len, tokens, microbatch_tokens, passes):
  assert passes_per_step(seq_len, tokens, microbatch_tokens) == passes


def test_model_vocabulary_follows_the_tokenizer_unless_set_apart():
  c = base_config()
  c.data.vocab_size = 512
  assert validate(c).model.vocab_size == 512
  c = base_config()
  c.model.vocab_size = 1152  # padded past the tokenizer's 1024: the tokenizer stays as it was
  assert validate(c).model.vocab_size == 1152 and c.data.vocab_size == 1024
  c = base_config()
  c.model.vocab_size = 1000
  with pytest.raises(ConfigError, match=r"model.vocab_size=1000 is smaller than the tokenizer's"):
    validate(c)


def test_derived_head_widths():
  c = validate(_with(model__kda__head_k_dim=None, model__mla__qk_nope_head_dim=None))
  assert c.model.kda.head_k_dim == 16 and c.model.mla.qk_nope_head_dim == 16


def test_entry_points_import_together():
  """Both command-line entry points import into one process (a test worker, a notebook) without
  claiming the same absl flag names at import time."""
  import subprocess
  import sys
  code = "import moejax.params, moejax.train; print('imported')"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "imported" in out.stdout


def test_compiler_options_name_real_xla_options():
  """The GPU options go to XLA only when a config turns them off, under names XLA knows: a misspelt
  option fails the compile ("No such compile option"), on the CPU too."""
  import jax

  from moejax.training.step import compiler_options

  assert compiler_options(_with()) == {"xla_allow_excess_precision": False}
  options = compiler_options(_with(train__xla_triton_gemm=False, train__xla_dot_merger=False))
  assert options == {"xla_allow_excess_precision": False, "xla_gpu_enable_triton_gemm": False,
                     "xla_gpu_dot_merger_threshold_mb": 0}
  assert float(jax.jit(lambda x: x @ x, compiler_options=options)(2.0 * jax.numpy.eye(2))[0, 0]) == 4.0


def test_config_choices_are_the_ops_implementations():
  """config.py imports no JAX, so it lists each op's implementations itself: the lists must be the ops'
  own (plus the config's 'auto' / None, and the MLA's cuDNN path), or a valid choice is refused."""
  from moejax import config
  from moejax.training import muon
  from pallas_kernels import attention, gmm, quantile, short_conv
  from pallas_kernels.kda import ops as kda

  assert set(config.NS_IMPLEMENTATIONS) == set(muon.NS_IMPLEMENTATIONS)
  assert set(config.CONV_IMPLEMENTATIONS) == set(short_conv.IMPLEMENTATIONS)
  assert set(config.GROUPED_MATMULS) == {"auto", *gmm.IMPLEMENTATIONS}
  assert set(config.BALANCE_IMPLEMENTATIONS) == {"auto", *quantile.ops.IMPLEMENTATIONS}
  assert set(config.KDA_IMPLEMENTATIONS) == {None, *kda.IMPLEMENTATIONS}
  assert set(config.MLA_ATTENTIONS) == {"auto", "cudnn", *attention.IMPLEMENTATIONS}
