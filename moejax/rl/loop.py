"""The RL run that `python -m moejax.rl` runs: SFT on generated tool-use demonstrations, then GRPO.

Steps are numbered across both stages: SFT takes steps 1..S (rl.sft.steps), GRPO iteration i is step
S + i. Checkpoints (`moejax.rl.checkpoint`) are saved when SFT ends and every rl.checkpoint_every
iterations; a killed run restarted in the same workdir resumes from the newest and continues exactly
(an SFT stage cut short is run again from its start: it is the cheap part). metrics.jsonl and
TensorBoard get one row per SFT step and per iteration.

An iteration (`iterate`): rollouts of rl.grpo.groups groups of group_size episodes (with the paused
episodes of earlier iterations first), advantages within each complete group, groups without spread
dropped and refilled (dynamic sampling), the trainer's log-probabilities checked against the
rollout's, then epochs x minibatches policy updates. Every rl.eval.every iterations the held-out
tasks are played once sampled and once greedy.
"""

import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from moejax.config import validate
from moejax.data import tokenizer as tk
from moejax.inference.engine import bucket
from moejax.inference.loading import (
  TextTokenizer,
  checkpoint_step,
  from_variables,
  read_config,
  restore_variables,
)
from moejax.model import build_model
from moejax.moe import replay
from moejax.rl import demonstrations as demos
from moejax.rl.batch import sft_batch, update_batch
from moejax.rl.checkpoint import RLCheckpoints
from moejax.rl.config import validate_rl
from moejax.rl.env import RESULT_CHARS
from moejax.rl.evaluate import evaluate
from moejax.rl.logprobs import token_logprobs
from moejax.rl.objective import mismatch_objective, policy_objective
from moejax.rl.rollout import Episode
from moejax.rl.update import advantages_of, collect, episode_metrics
from moejax.storage import resolve_workdir
from moejax.training import run_files
from moejax.training.monitor import Monitor, to_row
from moejax.training.run_files import CONFIG_FILE, TOKENIZER_FILE
from moejax.training.state import TrainState, init_state
from moejax.training.step import jit_eval_step, jit_train_step

log = logging.getLogger("moejax.rl")


def stage_config(config, lr: float, warmup: int) -> ml_collections.ConfigDict:
  """The run config with the optimizer of one stage: its learning rate after `warmup` updates, then
  constant, so that a stage's rates do not depend on its length (a resumed run may extend it)."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.optim.lr = c.optim.adam_lr = float(lr)
  c.optim.warmup_steps = int(warmup)
  c.optim.final_lr_fraction = 1.0
  return c


def _model_and_tokenizer(config, workdir: str, init: str | None):
  """(config with the model's sections, tokenizer, initial variables or None). From `init`: that run's
  model, tokenizer and newest weights. Otherwise: rl_tiny's own model and a tokenizer trained on the
  demonstrations (or the one a previous process of this run saved)."""
  if init:
    init = resolve_workdir(init)
    base = read_config(init)
    config.model, config.data = base.model, base.data
    tokenizer = TextTokenizer(tk.load_tokenizer(os.path.join(init, TOKENIZER_FILE)))
    directory = os.path.join(init, "checkpoints")
    variables = restore_variables(directory, build_model(base), checkpoint_step(directory))
    return validate(config), tokenizer, variables
  saved = os.path.join(workdir, TOKENIZER_FILE)
  if os.path.exists(saved):
    tokenizer = TextTokenizer(tk.load_tokenizer(saved))
  else:
    tokenizer = demos.train_rl_tokenizer(config.rl, demos.demonstration_texts(config.rl, config.rl.seed))
  config.data.vocab_size = int(config.rl.tokenizer_vocab)
  return validate(config), tokenizer, None


def _write_run_files(workdir: str, config, tokenizer: TextTokenizer) -> None:
  """config.json and tokenizer.json, as a training run writes them: `load_model(workdir)` works here."""
  run_files.write_json(os.path.join(workdir, CONFIG_FILE), config.to_dict())
  path = os.path.join(workdir, TOKENIZER_FILE)
  if not os.path.exists(path):
    tk.save_tokenizer(tokenizer._tok, path + ".tmp")  # noqa: SLF001 - the same package's tokenizer
    shutil.move(path + ".tmp", path)


def _fresh_state(model, config, seed: int, steps: int, variables):
  state, optimizer, _ = init_state(model, config, jax.random.key(seed), max(steps, 1))
  if variables is not None:
    params = jax.tree.map(jnp.asarray, variables["params"])
    state = state.replace(params=params, balance=variables.get("balance", state.balance),
                          opt_state=jax.jit(optimizer.init)(params))
  return state, optimizer


def run_sft(model, config, tokenizer, state, optimizer, monitor) -> TrainState:
  """rl.sft.steps steps of next-token loss on the demonstrations' replies."""
  s = config.rl.sft
  transcripts = [demos.tokenize_demonstration(tokenizer, task, replies)
                 for task, replies in demos.demonstration_texts(config.rl, config.rl.seed)]
  rows = sft_batch(transcripts, length=int(s.seq_len))  # checks every transcript fits
  step_fn = jit_train_step(model, optimizer, stage_config(config, s.lr, s.steps // 10), max(s.steps, 1))
  rng = np.random.default_rng([config.rl.seed, 2])
  for step in range(int(s.steps)):
    pick = rng.choice(len(transcripts), size=int(s.batch), replace=len(transcripts) < s.batch)
    state, metrics = step_fn(state, {k: jnp.asarray(v[pick]) for k, v in rows.items()})
    monitor.record(step + 1, {"stage": 0.0, **to_row({k: metrics[k] for k in ("loss", "nll", "grad_norm")})})
  return state


class Trainer:
  """The GRPO stage: the policy's state, the rollout model that shares its weights, the steps."""

  def __init__(self, model, config, tokenizer, state, optimizer, reference):
    self.config, self.rl, self.g = config, config.rl, config.rl.grpo
    cache_len = bucket(int(self.rl.episode_tokens) + int(self.rl.max_turn_tokens) + 4 * RESULT_CHARS, 16)
    self.lm = from_variables(config, {"params": state.params, "balance": state.balance}, tokenizer,
                             cache_len=cache_len)
    self.state, self.reference = state, reference
    updates = max(int(self.g.iterations) * int(self.g.minibatches) * int(self.g.epochs), 1)
    stage = stage_config(config, self.g.lr, 0)
    self.step_fn = jit_train_step(model, optimizer, stage, updates, loss_fn=policy_objective(self.g))
    self.mismatch_fn = jit_eval_step(model, config, mismatch_objective)
    self.make_env = demos.make_env_factory(self.rl)
    if reference is not None:
      self.reference_fn = jit_eval_step(model, config, _reference_logprobs)

  def sync_rollout_weights(self) -> None:
    self.lm.load_weights({"params": self.state.params, "balance": self.state.balance})

  def update(self, episodes, iteration: int) -> dict:
    """The policy updates on the kept episodes, after the log-probability check."""
    g = self.g
    rows = int(g.groups) * int(g.group_size)
    routing = None
    if g.routing_replay:
      routing = (len(replay.moe_layers(self.config.model)), int(self.config.model.moe.top_k))
    batch = update_batch([e.transcript for e in episodes], advantages_of(episodes), version=iteration,
                         aggregation=g.aggregation, rows=rows, routing=routing)
    metrics = to_row(self.mismatch_fn(self.state, {k: jnp.asarray(v) for k, v in batch.items()}))
    if self.reference is not None:
      ref_state = self.state.replace(params=self.reference)
      batch["ref_logp"] = np.asarray(self.reference_fn(ref_state, batch)["logp"])
    start = time.perf_counter()  # the policy steps alone: update tokens/s
    per = rows // int(g.minibatches)
    rng = np.random.default_rng([self.rl.seed, 3, iteration])
    rows_done, rows_metrics = 0, []
    for _ in range(int(g.epochs)):
      order = rng.permutation(rows)
      for m in range(int(g.minibatches)):
        pick = order[m * per:(m + 1) * per]
        if not batch["policy_mask"][pick].any():
          continue  # empty rows only: a step would move the weights by momentum and decay alone
        rows_batch = {k: jnp.asarray(v[pick]) for k, v in batch.items()}
        self.state, step_metrics = self.step_fn(self.state, rows_batch)
        rows_metrics.append(to_row({k: v for k, v in step_metrics.items() if np.ndim(v) == 0}))
        rows_done += int(batch["segment_ids"][pick].astype(bool).sum())
    jax.block_until_ready(self.state.params)
    seconds = time.perf_counter() - start
    for name in ("policy_loss", "clip_fraction", "kl", "entropy", "ratio", "grad_norm", "abs_logp_change"):
      if rows_metrics:
        metrics[name] = float(np.mean([r[name] for r in rows_metrics]))
    metrics["update_steps"] = float(len(rows_metrics))
    metrics["update_tokens_per_s"] = rows_done / seconds if seconds > 0 else 0.0
    self.sync_rollout_weights()
    return metrics


def _reference_logprobs(h_BTD, head_DV, batch, cfg_model):
  logp_BT, _ = token_logprobs(h_BTD, head_DV, batch["targets"], chunk=cfg_model.loss.chunk_tokens)
  return jnp.zeros((), jnp.float32), {"logp": logp_BT}


def run(config, workdir: str, init: str | None = None) -> dict:
  """SFT, then GRPO to rl.grpo.iterations; returns the last iteration's metrics row."""
  validate_rl(config)
  workdir = resolve_workdir(workdir)
  os.makedirs(workdir, exist_ok=True)
  config, tokenizer, variables = _model_and_tokenizer(config, workdir, init)
  validate_rl(config)
  _write_run_files(workdir, config, tokenizer)
  model = build_model(config)
  rl, g = config.rl, config.rl.grpo
  sft_steps = int(rl.sft.steps)
  total = sft_steps + int(g.iterations)
  checkpoints = RLCheckpoints(os.path.join(workdir, "checkpoints"), int(rl.keep_checkpoints))
  updates = max(int(g.iterations) * int(g.minibatches) * int(g.epochs), 1)
  rl_stage = stage_config(config, g.lr, 0)
  state, optimizer = _fresh_state(model, rl_stage, rl.seed, updates, variables)
  reference = state.params if g.kl_coef > 0 else None
  latest = checkpoints.latest_step()
  if latest is None:
    monitor = Monitor(workdir, config, total, start_step=0)
    if sft_steps:
      sft_cfg = stage_config(config, rl.sft.lr, sft_steps // 10)
      sft_state, sft_optimizer = _fresh_state(model, sft_cfg, rl.seed, sft_steps, variables)
      sft_state = run_sft(model, config, tokenizer, sft_state, sft_optimizer, monitor)
      params = sft_state.params
      state = state.replace(params=params, balance=sft_state.balance,
                            opt_state=jax.jit(optimizer.init)(params))
      reference = params if g.kl_coef > 0 else None
    loop = {"iteration": 0, "next_group": 0, "paused": []}
    trainer = Trainer(model, config, tokenizer, state, optimizer, reference)
    monitor.record(sft_steps, {"stage": 0.0, **evaluate(trainer, seed=rl.seed)})  # RL's starting point
    monitor.flush()
    checkpoints.save(sft_steps, state, reference, loop)
    log.info("SFT done (%d steps); checkpoint %d", sft_steps, sft_steps)
  else:
    state, reference, loop = checkpoints.restore(latest, state, reference)
    monitor = Monitor(workdir, config, total, start_step=latest)
    log.info("resumed at iteration %d (step %d)", loop["iteration"], latest)
    trainer = Trainer(model, config, tokenizer, state, optimizer, reference)

  row = {}
  paused = [Episode.from_dict(d) for d in loop["paused"]]
  next_group = int(loop["next_group"])
  for iteration in range(int(loop["iteration"]), int(g.iterations)):
    got = collect(trainer, paused, next_group, iteration)
    paused, next_group = got.paused, got.next_group
    row = {"stage": 1.0, "iteration": float(iteration + 1), **got.metrics, **episode_metrics(got.finished)}
    if got.kept:
      row.update(trainer.update(got.kept, iteration))
    if (iteration + 1) % int(rl.eval.every) == 0 or iteration + 1 == int(g.iterations):
      row.update(evaluate(trainer, seed=rl.seed))
    monitor.record(sft_steps + iteration + 1, row)
    if (iteration + 1) % int(rl.checkpoint_every) == 0 or iteration + 1 == int(g.iterations):
      monitor.flush()
      checkpoints.save(sft_steps + iteration + 1, trainer.state, trainer.reference,
                       {"iteration": iteration + 1, "next_group": next_group,
                        "paused": [e.to_dict() for e in paused]})
  monitor.close()
  checkpoints.close()
  return row
