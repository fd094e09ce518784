"""Multi-turn episodes end to end: the transcript holds the sampled ids and the encoded tool results in
order, only the policy's tokens enter the loss, and the trainer's log-probabilities of them are the
rollout's (float32, CPU)."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.inference.conversation import Conversation, GenerateOutput
from moejax.model import build_model
from moejax.rl.batch import update_batch
from moejax.rl.env import ToolEnv, tool_result
from moejax.rl.objective import mismatch_objective
from moejax.rl.rollout import new_episode, play
from moejax.rl.tasks import Task
from moejax.rl.tools.calculator import calculate
from moejax.rl.tools.result import ToolResult
from moejax.rl.transcript import Transcript
from moejax.training.state import init_state
from moejax.training.step import jit_eval_step
from tests.inference.test_generate import lm  # noqa: F401 - the fixture: a random float32 model


class ScriptedTokenizer:
  """Bytes as ids (+3 past pad, bos, eos): enough to read replies and encode results."""

  pad_id, bos_id, eos_id, vocab_size = 0, 1, 2, 259

  def encode(self, text, *, bos=True):
    return ([1] if bos else []) + [b + 3 for b in text.encode()]

  def decode(self, ids):
    return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")


def test_tool_env_answers_calls_scores_answers_and_refuses_bad_calls():
  env = ToolEnv({"calculator": calculate}, max_turns=3)
  task = Task("arithmetic", "Compute 12*34.", "408")
  assert env.reset(task) == "Task: Compute 12*34.\n"
  obs, reward, done, info = env.step('<tool name="calculator">12*34</tool>')
  assert (obs, reward, done) == (tool_result("408"), 0.0, False)
  assert (info["tool"], info["tool_error"]) == ("calculator", False)
  obs, _, done, info = env.step('<tool name="shell">ls</tool>')
  assert "no tool 'shell'" in obs and info["tool_error"] and not done
  obs, reward, done, _ = env.step("Answer: 408")
  assert (reward, done) == (1.0, True)
  env.reset(task)
  obs, _, _, info = env.step('<tool name="calculator">12*34')
  assert "malformed" in obs and info["tool_error"]
  env = ToolEnv({"calculator": lambda s: ToolResult(True, "x" * 1000)}, max_turns=1)
  env.reset(task)
  obs, reward, done, _ = env.step('<tool name="calculator">1</tool>')
  assert done and reward == 0.0 and len(obs) < 250  # turn limit; output cut


def test_inactive_rows_sit_out_a_turn_and_resume(lm):  # noqa: F811 - the fixture
  prompts = [[1, 5, 6, 7], [1, 9, 8]]
  conv = Conversation(lm, 2, seed=0)
  first = conv.turn(prompts, max_new_tokens=3)
  held = list(conv.lengths)
  second = conv.turn([[11], []], max_new_tokens=4, active=[True, False])
  assert second.tokens[1] == [] and second.finish_reasons[1] == "inactive" and len(second.tokens[0]) == 4
  assert conv.lengths[1] == held[1]
  third = conv.turn([[], [12, 13]], max_new_tokens=2, active=[False, True])
  # Row 1's tokens are those of a conversation where it alone took the turns it took.
  alone = Conversation(lm, 1, seed=0)
  alone.turn([prompts[1]], max_new_tokens=3)
  want = alone.turn([[12, 13]], max_new_tokens=2)
  assert third.tokens[1] == want.tokens[0]
  np.testing.assert_allclose(third.logprobs[1], want.logprobs[0], rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="left out"):
    conv.turn([[3], [4]], max_new_tokens=1, active=[True, False])
  assert first.tokens and len(first.tokens) == 2


class ScriptedConversation:
  """Stands in for `Conversation`: each row replies with the next of its scripted texts (then eos), and
  every feed is recorded, so the transcript can be checked token by token."""

  def __init__(self, scripts, tokenizer):
    self.scripts, self.tok, self.feeds = scripts, tokenizer, []

  def __call__(self, model, rows, *, seed):
    assert rows == len(self.scripts)
    return self

  def turn(self, feeds, *, max_new_tokens, temperature, eos_id, active):
    self.feeds.append([list(f) for f in feeds])
    tokens, logprobs, reasons = [], [], []
    for b, script in enumerate(self.scripts):
      if not active[b]:
        tokens.append([]), logprobs.append([]), reasons.append("inactive")
        continue
      ids = self.tok.encode(script.pop(0), bos=False) + [eos_id]
      tokens.append(ids), logprobs.append([-0.5] * len(ids)), reasons.append("eos")
    return GenerateOutput(tokens, logprobs, reasons)


def test_multi_turn_transcript_feeds_and_mask_end_to_end():
  tok = ScriptedTokenizer()
  scripts = [['<tool name="calculator">12*34</tool>', "Answer: 408"],  # right, after one call
             ['<tool name="calc">1</tool>', '<tool name="calculator">2+2</tool>', "Answer: 4"]]  # wrong
  fake = ScriptedConversation([list(s) for s in scripts], tok)
  make_env = lambda: ToolEnv({"calculator": calculate}, max_turns=4)
  task = Task("arithmetic", "Compute 12*34.", "408")
  episodes = [new_episode(task, 0, tok, make_env()) for _ in range(2)]
  model = types.SimpleNamespace(tokenizer=tok)  # all that play reads of a model besides its conversation
  play(model, episodes, make_env, version=3, seed=0, temperature=1.0, max_turn_tokens=64, episode_tokens=512,
       conversation=fake)
  prompt = tok.encode("Task: Compute 12*34.\n", bos=True)
  reply = lambda text: tok.encode(text, bos=False) + [tok.eos_id]
  result = lambda text: tok.encode(tool_result(text), bos=False)
  first, second = episodes
  want = [(prompt, 0), (reply(scripts[0][0]), 1), (result("408"), 0), (reply(scripts[0][1]), 1)]
  assert first.transcript.tokens == [t for ids, _ in want for t in ids]
  assert first.transcript.policy_mask == [m for ids, m in want for _ in ids]
  assert first.transcript.versions == [3 if m else -1 for ids, m in want for _ in ids]
  assert (first.reward, first.passed, first.turns) == (1.0, True, 2)
  assert (first.tool_calls, first.tool_errors) == (1, 0)
  assert (second.reward, second.turns, second.tool_calls, second.tool_errors) == (0.0, 3, 2, 1)
  # Each turn feeds only what is new: the prompts, then the tool results; a finished row sits out.
  assert fake.feeds[0] == [prompt, prompt]
  assert fake.feeds[1] == [result("408"), result("error: no tool 'calc'; tools: calculator")]
  assert fake.feeds[2] == [[], result("4")]
  # The loss sees the policy's tokens only: every target inside a tool result or the prompt is masked.
  batch = update_batch([e.transcript for e in episodes], [1.0, -1.0], version=3, aggregation="token-mean")
  for b, e in enumerate(episodes):
    n = len(e.transcript) - 1
    np.testing.assert_array_equal(batch["policy_mask"][b, :n], e.transcript.policy_mask[1:])
    np.testing.assert_array_equal(batch["targets"][b, :n], e.transcript.tokens[1:])
    np.testing.assert_array_equal(batch["fresh"][b, :n], e.transcript.policy_mask[1:])
    assert batch["policy_mask"][b, n:].sum() == 0 and batch["segment_ids"][b, n:].sum() == 0
    np.testing.assert_allclose(batch["old_logp"][b, :n], np.where(batch["policy_mask"][b, :n] > 0, -0.5, 0.0))


def test_trainer_logprobs_match_the_rollouts_over_multi_turn_episodes(lm):  # noqa: F811
  """The rollout's log-probabilities (cached decode, turn after turn, tool results fed between) against
  the training forward pass of the same float32 weights over the finished transcripts."""
  conversation = Conversation(lm, 3, seed=1)
  transcripts = [Transcript() for _ in range(3)]
  feeds = [[1, 40, 41, 42], [1, 50], [1, 60, 61]]
  for turn in range(3):
    for t, f in zip(transcripts, feeds, strict=True):
      t.add_context(f)
    out = conversation.turn(feeds, max_new_tokens=4, temperature=1.0)  # one decode program
    for t, ids, logp in zip(transcripts, out.tokens, out.logprobs, strict=True):
      t.add_policy(ids, logp, version=0)
    feeds = [[100 + turn, 7, 8], [9], [120, 121]]  # a tool's result, say
  batch = update_batch(transcripts, [1.0] * 3, version=0, aggregation="token-mean")
  model = build_model(lm.config)
  state, _, _ = init_state(model, lm.config, jax.random.key(0), 1)
  state = state.replace(params=lm.variables["params"], balance=lm.variables["balance"])
  arrays = {k: jnp.asarray(v) for k, v in batch.items()}
  metrics = jit_eval_step(model, lm.config, mismatch_objective)(state, arrays)
  print("logp mismatch", metrics)
  assert 0 < float(metrics["logp_mismatch"]) < 1e-4, metrics  # zero would mean the same path ran twice
  assert float(metrics["logp_mismatch_max"]) < 1e-3, metrics


def test_routing_replay_carries_the_rollouts_experts_into_the_update(lm):  # noqa: F811
  """With routing recorded, the update batch's replay_experts are the experts each input position took
  in the rollout; the trainer's forward routes by them even where its own router would choose others
  (here: after the router moved), and its log-probabilities stay the rollout's."""
  from moejax.moe import replay
  from moejax.training.step import replayed_routing

  policy = dataclasses.replace(lm, tokenizer=ScriptedTokenizer())
  make_env = lambda: ToolEnv({"calculator": calculate}, max_turns=3)
  episodes = [new_episode(Task("arithmetic", "Compute 2+3.", "5"), 0, policy.tokenizer, make_env())
              for _ in range(2)]
  cfg = lm.config.model
  shape = (len(replay.moe_layers(cfg)), cfg.moe.top_k)
  play(policy, episodes, make_env, version=0, seed=3, temperature=1.0, max_turn_tokens=6, episode_tokens=96,
       conversation=functools.partial(Conversation, record_routing=True))
  for e in episodes:
    assert len(e.transcript.routing) == len(e.transcript) - 1  # every position but the last was fed
  batch = update_batch([e.transcript for e in episodes], [1.0, -1.0], version=0, aggregation="token-mean",
                       routing=shape)
  replayed = batch["replay_experts"]
  m = len(episodes[0].transcript) - 1
  assert replayed.shape[2:] == shape and (replayed[0, :m] >= 0).all() and (replayed[0, m:] == -1).all()
  apply = jax.jit(lambda v, b: lm.model.apply({**v, **replayed_routing(b, cfg)}, b["tokens"],
                                              b["segment_ids"], mutable=[replay.ROUTING])[1])
  arrays = {k: jnp.asarray(v) for k, v in batch.items()}
  taken = lambda v, b: np.asarray(replay.stack(apply(v, b)[replay.ROUTING], cfg))
  real = replayed >= 0
  np.testing.assert_array_equal(taken(lm.variables, arrays)[real], replayed[real])
  # A moved router: left alone it routes some positions elsewhere; replayed, as the rollout did.
  moved = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.5 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
      if "router" in jax.tree_util.keystr(p) else x, lm.variables["params"])
  moved = {**lm.variables, "params": moved}
  own = {k: v for k, v in arrays.items() if k != "replay_experts"}
  assert (taken(moved, own)[real] != replayed[real]).any()
  np.testing.assert_array_equal(taken(moved, arrays)[real], replayed[real])
  model = build_model(lm.config)
  state, _, _ = init_state(model, lm.config, jax.random.key(0), 1)
  state = state.replace(params=lm.variables["params"], balance=lm.variables["balance"])
  metrics = jit_eval_step(model, lm.config, mismatch_objective)(state, arrays)
  assert float(metrics["logp_mismatch"]) < 1e-4, metrics
