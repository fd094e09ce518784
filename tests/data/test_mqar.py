"""MQAR rows: every query returns a stated key once and is followed by that key's value, the loss mask
marks exactly the queries, rows depend on (seed, split, stream, index) alone, and the iterator resumes
from its state."""

import hypothesis.strategies as st
import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings

from moejax.data import mqar
from moejax.errors import ConfigError


def config(pairs=4, key_ids=8, value_ids=8, filler_ids=5):
  c = mqar.default_mqar_config()
  c.update(pairs=pairs, key_ids=key_ids, value_ids=value_ids, filler_ids=filler_ids)
  return c


@settings(max_examples=30, deadline=None)
@given(pairs=st.integers(1, 12), extra=st.integers(0, 300), seed=st.integers(0, 2**31),
       index=st.integers(0, 99))
def test_a_row_states_pairs_and_queries_each_key_once(pairs, extra, seed, index):
  c = config(pairs=pairs, key_ids=pairs + 3)
  length = mqar.min_length(c) + extra
  row = mqar.example(c, length, mqar.example_rng(seed, "train", 0, index))
  tokens, targets, mask = row["tokens"], row["targets"], row["loss_mask"]
  assert tokens.shape == targets.shape == mask.shape == (length,)
  np.testing.assert_array_equal(tokens[1:], targets[:-1])
  keys, values = tokens[0:2 * pairs:2], tokens[1:2 * pairs:2]
  assert len(set(keys.tolist())) == pairs
  first_value = mqar.FIRST_ID + c.key_ids
  assert np.all((keys >= mqar.FIRST_ID) & (keys < first_value))
  assert np.all((values >= first_value) & (values < first_value + c.value_ids))
  asked = np.flatnonzero(mask)
  assert len(asked) == pairs and np.all(asked >= 2 * pairs)
  answer = dict(zip(keys.tolist(), values.tolist(), strict=True))
  assert sorted(tokens[asked].tolist()) == sorted(keys.tolist())  # each key once
  assert [answer[k] for k in tokens[asked]] == targets[asked].tolist()
  # everything after the pairs that is not a query or its answer is filler
  rest = np.ones(length + 1, bool)
  rest[:2 * pairs] = False
  rest[asked] = rest[asked + 1] = False
  seq = np.concatenate([tokens, targets[-1:]])
  assert np.all(seq[rest] >= first_value + c.value_ids) and np.all(seq[rest] < mqar.vocab_needed(c))
  assert np.all(row["segment_ids"] == 1) and np.array_equal(row["positions"], np.arange(length))


def test_rows_are_reproducible_and_splits_differ():
  c = config()
  a = mqar.batch(c, 40, 3, seed=1, split="train", stream=0, start=5)
  b = mqar.batch(c, 40, 3, seed=1, split="train", stream=0, start=5)
  np.testing.assert_array_equal(a["tokens"], b["tokens"])
  for other in (dict(split="validation", stream=0), dict(split="train", stream=1)):
    assert not np.array_equal(a["tokens"], mqar.batch(c, 40, 3, seed=1, start=5, **other)["tokens"])


def test_the_iterator_resumes_from_its_state():
  c = config()
  it = mqar.MQARIterator(c, seq_len=32, batch_size=2, seed=0, split="train", stream=0)
  next(it)
  state = it.get_state()
  want = next(it)
  again = mqar.MQARIterator(c, seq_len=32, batch_size=2, seed=0, split="train", stream=0)
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["tokens"], want["tokens"])


def test_bad_settings_are_named():
  with pytest.raises(ConfigError, match="data.mqar.pairs=9 needs as many distinct keys"):
    mqar.validate_mqar(config(pairs=9, key_ids=8), 512)
  with pytest.raises(ConfigError, match="raise data.vocab_size"):
    mqar.validate_mqar(config(key_ids=300), 260)
  with pytest.raises(ConfigError, match="filler_ids"):
    mqar.validate_mqar(config(filler_ids=0), 512)
  with pytest.raises(ConfigError, match="too short"):
    mqar.MQARIterator(config(), seq_len=15, batch_size=1, seed=0, split="train", stream=0)
  assert isinstance(mqar.default_mqar_config(), ml_collections.ConfigDict)
