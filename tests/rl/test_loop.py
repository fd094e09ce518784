"""The RL loop end to end on a very small model: SFT, then three GRPO iterations with paused episodes;
the iterations move the policy, and a run stopped after two and restarted continues bit-exactly."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest

from moejax.config import load_experiment
from moejax.errors import ConfigError
from moejax.inference import load_model
from moejax.inference.loading import restore_variables
from moejax.model import build_model
from moejax.rl.loop import run

ROOT = pathlib.Path(__file__).resolve().parents[2]


def small_rl_config(iterations: int):
  c = load_experiment(ROOT / "experiments" / "rl_tiny.py")
  m = c.model
  m.update(num_layers=2, layer_pattern="KM", num_dense_layers=1, d_model=32)
  m.kda.update(num_heads=2, gate_rank=8, chunk_size=16, implementation="xla", conv_implementation="xla")
  m.mla.update(num_heads=2, q_lora_rank=16, kv_lora_rank=16)
  m.moe.update(num_experts=4, top_k=2, latent_dim=16, expert_hidden_dim=16, shared_hidden_dim=32)
  m.ffn.hidden_dim = 64
  r = c.rl
  r.tokenizer_vocab = 300
  r.max_turns, r.max_turn_tokens, r.episode_tokens = 3, 24, 128
  # Enough SFT for replies in the format, which end at eos: the episodes then take several turns.
  r.sft.update(examples=16, steps=40, batch=8, lr=1e-2, direct_fraction=0.0)
  # A budget of one token pauses every episode after its first turn; the length penalty gives the
  # groups advantages whatever the rewards
  # groups; a KL term to a frozen reference, which checkpoints keep too.
  # Routing replay on: the paused episodes carry their recorded experts through the checkpoints.
  r.grpo.update(iterations=iterations, groups=2, group_size=2, minibatches=2, dynamic_sampling=False,
                overlong_cache=100, rollout_tokens=1, max_staleness=1, kl_coef=0.05, routing_replay=True)
  r.eval.update(tasks=2, every=3)
  r.checkpoint_every, r.keep_checkpoints = 1, 5
  return c


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _params(workdir, step):
  config = load_model(workdir).config
  return restore_variables(os.path.join(workdir, "checkpoints"), build_model(config), step)["params"]


def test_three_iterations_update_the_policy_and_resume_bit_exactly(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # relative workdirs, as a user gives them
  straight = run(small_rl_config(3), "straight")
  assert straight["iteration"] == 3.0
  rows = [r for r in _rows("straight") if r.get("stage") == 1.0]
  assert [r["iteration"] for r in rows] == [1.0, 2.0, 3.0]
  assert sum(r["episodes_paused"] for r in rows) > 0  # the token budget paused episodes
  assert sum(r.get("update_steps", 0) for r in rows) > 0
  for r in rows:
    if "logp_mismatch" in r:
      assert r["logp_mismatch"] < 1e-4  # float32 on CPU: the trainer's log-probabilities are the rollout's
  assert any(r.get("kl", 0) > 0 for r in rows)  # the policy moved away from the reference
  sft_end, last = _params("straight", 40), _params("straight", 43)
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), sft_end, last)
  assert any(jax.tree.leaves(moved))

  run(small_rl_config(2), "resumed")  # stopped after two iterations ...
  resumed = run(small_rl_config(3), "resumed")  # ... and restarted: it resumes at iteration 2
  jax.tree.map(np.testing.assert_array_equal, _params("resumed", 43), last)
  assert {k: v for k, v in resumed.items() if "per_s" not in k and "seconds" not in k} == \
      {k: v for k, v in straight.items() if "per_s" not in k and "seconds" not in k}
  # The generation API reads an RL workdir like a training run's.
  assert load_model("resumed").step == 43


def test_bad_rl_configs_are_refused(tmp_path):
  c = small_rl_config(1)
  c.rl.grpo.group_size = 1
  with pytest.raises(ConfigError, match="group_size"):
    run(c, str(tmp_path / "w"))
  c = small_rl_config(1)
  c.rl.tasks = ("poetry",)
  with pytest.raises(ConfigError, match="rl.tasks"):
    run(c, str(tmp_path / "w"))
  c = small_rl_config(1)
  del c.rl
  with pytest.raises(ConfigError, match="no rl section"):
    run(c, str(tmp_path / "w"))
