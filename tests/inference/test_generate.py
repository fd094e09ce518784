"""Generation against the plain forward pass: greedy decoding is the argmax of `lm.logits` over the
growing row, whatever the batch, the prompt lengths, the prefill pieces or the turns of a conversation.
Float32 on the XLA paths, so the cached and the whole-row orders of summation agree to rounding."""

import dataclasses

import chex
import jax
import numpy as np
import pytest

from moejax.config import base_config
from moejax.inference import Conversation, generate, random_model, stream
from moejax.inference import engine as engine_lib
from moejax.inference.engine import bucket

VOCAB = 300


def small_config(dtype: str = "float32", scan: bool = False):
  """KDA and MLA layers, dense and MoE FFNs, AttnRes; KDA chunks of 16 so that prompts cross them."""
  c = base_config()
  c.data.vocab_size = VOCAB
  m = c.model
  m.update(num_layers=4, layer_pattern="KM", num_dense_layers=1, d_model=32, dtype=dtype, scan_layers=scan)
  m.kda.update(num_heads=2, head_k_dim=16, head_v_dim=16, gate_rank=8, chunk_size=16, implementation="xla",
               conv_implementation="xla")
  m.mla.update(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
               attention="xla")
  m.attnres.update(block_size=2)
  m.ffn.hidden_dim = 48
  m.moe.update(num_experts=4, top_k=2, shared_hidden_dim=32, latent_dim=16, expert_hidden_dim=16,
               grouped_matmul="xla", balance_implementation="xla")
  c.train.stages = ((128, 1, 128),)
  return c


@pytest.fixture(scope="module")
def lm():
  return random_model(small_config(), seed=1)


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def _greedy_reference(lm, prompt, n):
  """n greedy tokens and their log-probabilities from full forward passes over the growing row."""
  row, tokens, logprobs = list(prompt), [], []
  for _ in range(n):
    logits = lm.logits(row)[-1].astype(np.float64)
    token = int(np.argmax(logits))
    logprobs.append(float(logits[token] - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()))
    tokens.append(token)
    row.append(token)
  return tokens, logprobs


def test_greedy_is_the_argmax_of_the_full_forward(lm):
  """Prompts of one token, odd lengths, and lengths across a KDA chunk boundary, in one batch."""
  prompts = _prompts([1, 7, 17, 33])
  out = generate(lm, prompts, max_new_tokens=6)
  assert out.finish_reasons == ["length"] * 4
  for b, prompt in enumerate(prompts):
    tokens, logprobs = _greedy_reference(lm, prompt, 6)
    assert out.tokens[b] == tokens, b
    np.testing.assert_allclose(out.logprobs[b], logprobs, atol=1e-4)


def test_a_prompt_generates_the_same_alone_and_in_a_batch(lm):
  prompts = _prompts([9, 2, 30], seed=1)
  together = generate(lm, prompts, max_new_tokens=5)
  alone = generate(lm, [prompts[0]], max_new_tokens=5)
  assert alone.tokens[0] == together.tokens[0]
  np.testing.assert_allclose(alone.logprobs[0], together.logprobs[0], atol=1e-5)


def test_prefill_in_pieces_equals_one_pass(lm):
  prompts = _prompts([40, 21], seed=2)
  whole = generate(lm, prompts, max_new_tokens=4)
  pieces = generate(dataclasses.replace(lm, prefill_chunk=16), prompts, max_new_tokens=4)
  assert pieces.tokens == whole.tokens
  np.testing.assert_allclose(np.asarray(pieces.logprobs), np.asarray(whole.logprobs), atol=1e-5)


def test_a_conversation_reuses_its_state_across_turns(lm):
  """Turn two feeds only its new tokens; its reply equals greedy decoding over the whole history
  (prompt, first reply, new tokens), and the caches hold every token but the last drawn."""
  first, second = _prompts([5, 12], seed=3), _prompts([3, 0], seed=4)
  conversation = Conversation(lm, 2)
  reply1 = conversation.turn(first, max_new_tokens=4)
  reply2 = conversation.turn(second, max_new_tokens=5)
  for b in range(2):
    history = first[b] + reply1.tokens[b] + second[b]
    tokens, logprobs = _greedy_reference(lm, history, 5)
    assert reply2.tokens[b] == tokens, b
    np.testing.assert_allclose(reply2.logprobs[b], logprobs, atol=1e-4)
    assert conversation.lengths[b] == len(history) + 4


def test_eos_stops_a_row_and_is_kept(lm):
  prompts = _prompts([6, 11], seed=5)
  free = generate(lm, prompts, max_new_tokens=6)
  eos = free.tokens[0][2]
  out = generate(lm, prompts, max_new_tokens=6, eos_id=eos)
  stop = free.tokens[0].index(eos)
  assert out.tokens[0] == free.tokens[0][:stop + 1]
  assert out.finish_reasons[0] == "eos"
  row1 = free.tokens[1][:free.tokens[1].index(eos) + 1] if eos in free.tokens[1] else free.tokens[1]
  assert out.tokens[1] == row1
  assert out.finish_reasons[1] == ("eos" if eos in free.tokens[1] else "length")


def test_stream_yields_what_generate_gives(lm):
  prompt = _prompts([10], seed=6)[0]
  out = generate(lm, [prompt], max_new_tokens=7, temperature=0.9, top_k=50, seed=3)
  assert list(stream(lm, prompt, max_new_tokens=7, temperature=0.9, top_k=50, seed=3)) == out.tokens[0]


def test_a_stream_of_prompts_compiles_a_bounded_number_of_programs(monkeypatch):
  """Prompts of 1 to 40 tokens with 3 new ones: pieces of 16, 32 or 64 tokens into caches of 16, 32
  or 64 positions, (piece, cache) in {(16, 16), (16, 32), (32, 32), (32, 64), (64, 64)}: five prefill
  programs and three decode programs, however many prompts come."""
  chex.clear_trace_counter()
  monkeypatch.setattr(engine_lib, "prefill_piece", chex.assert_max_traces(engine_lib.prefill_piece, n=5))
  monkeypatch.setattr(engine_lib, "decode_block", chex.assert_max_traces(engine_lib.decode_block, n=3))
  lm = random_model(small_config(), seed=2)  # a fresh engine, which jits the counted functions
  for n in [1, 13, 14, 16, 17, 29, 30, 32, 33, 40] + np.random.default_rng(7).integers(1, 41, 6).tolist():
    generate(lm, _prompts([n], seed=n), max_new_tokens=3)


def test_errors(lm):
  with pytest.raises(ValueError, match="empty"):
    generate(lm, [[5], []], max_new_tokens=2)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    generate(lm, [[5, VOCAB]], max_new_tokens=2)
  with pytest.raises(ValueError, match="beyond the cache"):
    generate(lm, [[5] * 100], max_new_tokens=29)  # 129 > cache_len 128
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(lm, [[5]], max_new_tokens=0)
  with pytest.raises(ValueError, match="temperature"):
    generate(lm, [[5]], max_new_tokens=2, temperature=-1.0)
  with pytest.raises(ValueError, match="top_p"):
    generate(lm, [[5]], max_new_tokens=2, temperature=1.0, top_p=1.5)
  with pytest.raises(ValueError, match="non-empty list"):
    generate(lm, [], max_new_tokens=2)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    lm.logits([-1])


def test_bfloat16_generates_a_thousand_finite_tokens():
  lm = random_model(small_config("bfloat16"), seed=3, cache_len=1024)
  out = generate(lm, _prompts([3, 8], seed=8), max_new_tokens=1000, temperature=1.0, seed=1)
  assert [len(t) for t in out.tokens] == [1000, 1000]
  assert np.all(np.isfinite(np.asarray(out.logprobs)))
  assert all(0 <= t < VOCAB for row in out.tokens for t in row)


def test_bucket():
  assert [bucket(n, 16) for n in (1, 16, 17, 33)] == [16, 16, 32, 64]
  assert bucket(3) == 4 and bucket(1) == 1
  assert jax.tree.leaves(engine_lib.grow_cache({"latent": np.zeros((2, 4, 3))}, 8))[0].shape == (2, 8, 3)


def test_recorded_routing_is_the_whole_rows_routing(lm):
  """Conversation(record_routing=True) keeps the experts every fed position took, over prefill pieces,
  decode steps and a second turn: those of one forward pass over the row's held tokens (float32: the
  same choices). The caches and the record grow together; a conversation that does not record refuses."""
  from moejax.moe import replay

  small = dataclasses.replace(lm, prefill_chunk=16)
  prompts = _prompts([21, 5])
  chat = Conversation(small, 2, record_routing=True)
  first = chat.turn(prompts, max_new_tokens=6)
  second = chat.turn([[7, 8, 9], []], max_new_tokens=40, active=[True, False])  # grows the caches
  rows = [prompts[0] + first.tokens[0] + [7, 8, 9] + second.tokens[0], prompts[1] + first.tokens[1]]
  cfg = small.model.cfg
  for b, row in enumerate(rows):
    got = chat.routing(b)
    assert got.shape == (chat.lengths[b], len(replay.moe_layers(cfg)), cfg.moe.top_k)
    assert chat.lengths[b] == len(row) - 1  # all but the last drawn token, which waits to be fed
    _, sown = small.model.apply(small.variables, np.asarray([row[:-1]], np.int32), mutable=[replay.ROUTING])
    np.testing.assert_array_equal(got, np.asarray(replay.stack(sown[replay.ROUTING], cfg))[0])
  with pytest.raises(ValueError, match="record_routing=True"):
    Conversation(small, 1).routing(0)
