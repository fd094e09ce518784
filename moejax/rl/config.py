"""The `rl` section of a run config (`python -m moejax.rl`), its defaults and its validation.

An RL config is a whole run config (`moejax.config.base_config`: model, optim, train) plus this
section. With `--init PRETRAINED_WORKDIR` the model and tokenizer come from that run instead, and
only the `rl` and `optim` sections of the RL config apply.
"""

import ml_collections

from moejax.errors import ConfigError
from moejax.rl.grpo import AGGREGATIONS

TASK_KINDS = ("arithmetic", "countdown", "docstring")
TOOL_NAMES = ("calculator", "python", "search")


def rl_config() -> ml_collections.ConfigDict:
  r = ml_collections.ConfigDict()
  r.seed = 0
  r.tasks = ("arithmetic",)  # drawn uniformly, each episode one task
  r.tools = TOOL_NAMES
  r.arithmetic_digits = (2, 3)  # widths of the arithmetic task's numbers
  r.tokenizer_vocab = 512  # a tokenizer trained on the SFT transcripts, where no --init run gives one
  r.max_turns = 4  # replies per episode
  r.max_turn_tokens = 48  # tokens per reply
  r.episode_tokens = 384  # per-episode budget: an episode whose transcript passes it ends, reward 0
  r.python_timeout_s = 5.0

  s = r.sft = ml_collections.ConfigDict()
  s.examples = 400  # generated transcripts
  # Share of the transcripts that answer without calling a tool (the right answer, stated directly):
  # what the model would copy from a teacher that knows; a model too small to multiply in its head
  # must learn in RL that calling the calculator pays.
  s.direct_fraction = 0.5
  s.steps = 200
  s.batch = 16
  s.seq_len = 64  # rows of the SFT batches (a power of two); longer transcripts are refused
  s.lr = 3e-3

  g = r.grpo = ml_collections.ConfigDict()
  g.iterations = 30
  g.groups = 8  # prompts per iteration
  g.group_size = 8  # samples per prompt
  g.temperature = 1.0
  g.clip_low = 0.2
  g.clip_high = 0.28
  g.kl_coef = 0.0  # > 0: a frozen reference (the starting policy) and the k3 KL term
  g.aggregation = "token-mean"
  g.advantage_scale = "std"  # group_advantages' scale
  g.dynamic_sampling = True  # drop groups whose rewards are all equal, and refill ...
  g.refill_rounds = 2  # ... with up to this many more rounds of fresh groups
  g.overlong_cache = 0  # > 0: DAPO's soft overlong penalty over the last this many of episode_tokens
  g.minibatches = 2  # policy updates per batch, each on its share of the episodes
  g.epochs = 1  # passes over the batch
  g.lr = 1e-3
  # Partial rollouts: sampled tokens an iteration may spend (0: no limit). Episodes still running when
  # it is spent are paused at a turn's end and resume in the next iteration under the newer policy;
  # one drawn by a policy more than max_staleness versions old is dropped with its group.
  g.rollout_tokens = 0
  g.max_staleness = 2
  # Routing replay (moejax/moe/replay.py): the rollout records the experts every position took, and the
  # updates route those positions the same way; the router's weights of them still train. Needs
  # model.scan_layers False.
  g.routing_replay = False

  e = r.eval = ml_collections.ConfigDict()
  e.tasks = 64  # held-out tasks of each kind, one sample each (at grpo.temperature) and one greedy
  e.every = 5  # iterations
  r.checkpoint_every = 5  # iterations
  r.keep_checkpoints = 3
  return r


def validate_rl(config) -> ml_collections.ConfigDict:
  """Raises ConfigError naming the offending field of config.rl."""
  if "rl" not in config:
    raise ConfigError("the config has no rl section: start an RL config from moejax.rl.config.rl_config()")
  r = config.rl

  def need(cond, msg):
    if not cond:
      raise ConfigError(msg)

  need(len(r.tasks) > 0 and set(r.tasks) <= set(TASK_KINDS),
       f"rl.tasks={r.tasks!r}: choose from {TASK_KINDS}")
  need(set(r.tools) <= set(TOOL_NAMES), f"rl.tools={r.tools!r}: choose from {TOOL_NAMES}")
  need(r.max_turns >= 1 and r.max_turn_tokens >= 1 and r.episode_tokens >= 2,
       "rl.max_turns, rl.max_turn_tokens and rl.episode_tokens must be positive")
  need(len(r.arithmetic_digits) == 2 and min(r.arithmetic_digits) >= 1,
       f"rl.arithmetic_digits={r.arithmetic_digits!r} must be two widths >= 1")
  s, g = r.sft, r.grpo
  need(s.examples >= 1 and s.steps >= 0 and s.batch >= 1 and s.seq_len >= 16,
       "rl.sft: examples >= 1, steps >= 0, batch >= 1 and seq_len >= 16")
  need(0.0 <= s.direct_fraction <= 1.0, f"rl.sft.direct_fraction={s.direct_fraction} must lie in [0, 1]")
  need(g.iterations >= 0 and g.groups >= 1 and g.group_size >= 2,
       "rl.grpo: iterations >= 0, groups >= 1 and group_size >= 2 (advantages compare samples in a group)")
  need(g.temperature > 0,
       f"rl.grpo.temperature={g.temperature} must be > 0: the ratio needs a sampling policy")
  need(0 <= g.clip_low < 1 and g.clip_high >= 0, "rl.grpo: need 0 <= clip_low < 1 and clip_high >= 0")
  need(g.kl_coef >= 0, "rl.grpo.kl_coef must be >= 0")
  need(g.aggregation in AGGREGATIONS, f"rl.grpo.aggregation={g.aggregation!r} not in {AGGREGATIONS}")
  need(g.advantage_scale in ("std", "none"), "rl.grpo.advantage_scale must be 'std' or 'none'")
  need(g.refill_rounds >= 0 and 0 <= g.overlong_cache <= r.episode_tokens,
       "rl.grpo: refill_rounds >= 0 and 0 <= overlong_cache <= rl.episode_tokens")
  need(g.minibatches >= 1 and g.epochs >= 1, "rl.grpo.minibatches and epochs must be >= 1")
  need((g.groups * g.group_size) % g.minibatches == 0,
       f"rl.grpo.minibatches={g.minibatches} must divide the {g.groups * g.group_size} episodes of a batch")
  need(g.rollout_tokens >= 0 and g.max_staleness >= 0, "rl.grpo: rollout_tokens and max_staleness >= 0")
  need(g.lr > 0 and s.lr > 0, "rl.sft.lr and rl.grpo.lr must be > 0")
  need(not (g.routing_replay and config.model.scan_layers),
       "rl.grpo.routing_replay needs model.scan_layers=False: scanned layers' choices are not recorded")
  need(r.eval.tasks >= 1 and r.eval.every >= 1 and r.checkpoint_every >= 1 and r.keep_checkpoints >= 1,
       "rl.eval.tasks, rl.eval.every, rl.checkpoint_every and rl.keep_checkpoints must be >= 1")
  return config
