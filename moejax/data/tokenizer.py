"""Byte-level BPE, trained locally with the `tokenizers` package and stored as one JSON file.

Byte-level means every string round-trips exactly: `decode(encode(x)) == x` for any Unicode
text, because the base alphabet is the 256 bytes and merges only ever join them. Three special
tokens come first in the vocabulary: PAD (0, what packed rows are padded with), BOS and EOS (put
around every document by `encode_document`).
"""

import os
from collections.abc import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS, IMAGE = "<|pad|>", "<|bos|>", "<|eos|>", "<|image|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
PAD_ID, BOS_ID, EOS_ID, IMAGE_ID = 0, 1, 2, 3
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1  # room for IMAGE too


def _empty_byte_level(individual_digits: bool = False) -> Tokenizer:
  tok = Tokenizer(models.BPE())
  # No prefix space: it would add a character the decoder cannot tell from real text.
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.pre_tokenizer = byte_level if not individual_digits else pre_tokenizers.Sequence(
      [pre_tokenizers.Digits(individual_digits=True), byte_level])
  tok.decoder = decoders.ByteLevel()
  return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, individual_digits: bool = False,
                    image_token: bool = False) -> Tokenizer:
  """Trains a byte-level BPE of at most `vocab_size` entries (fewer if the text runs out of
  pairs to merge). Training is deterministic for a given text stream. individual_digits: every digit
  is a token of its own, never merged (nor with a space before it), so that a number is spelt the same
  ids wherever it stands: after a space in a sentence, after a '>' in a tool call. image_token: reserve
  IMAGE at IMAGE_ID, the image placeholder of vision runs."""
  if vocab_size < MIN_VOCAB_SIZE:
    raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs the 256 byte "
                     f"symbols plus {len(SPECIAL_TOKENS)} special tokens and room for the image "
                     f"placeholder, so at least {MIN_VOCAB_SIZE}")
  tok = _empty_byte_level(individual_digits)
  specials = list(SPECIAL_TOKENS) + ([IMAGE] if image_token else [])
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  return _ready(tok)


def _ready(tok: Tokenizer) -> Tokenizer:
  check_special_ids(tok)
  # A document that contains the text "<|eos|>" must not end early: special tokens are only ever
  # inserted by encode_documents, never matched in the text. (Not stored in the JSON file.)
  tok.encode_special_tokens = True
  return tok


def check_special_ids(tok: Tokenizer) -> None:
  for name, want in zip(SPECIAL_TOKENS, (PAD_ID, BOS_ID, EOS_ID), strict=True):
    got = tok.token_to_id(name)
    if got != want:
      raise ValueError(f"tokenizer maps special token {name!r} to {got}, expected {want}: "
                       f"it was not built by moejax.data.tokenizer")
  got = tok.token_to_id(IMAGE)
  if got is not None and got != IMAGE_ID:
    raise ValueError(f"tokenizer maps {IMAGE!r} to {got}, expected {IMAGE_ID}")


def has_image_token(tok: Tokenizer) -> bool:
  """Whether the tokenizer reserves the image placeholder (trained with image_token=True)."""
  return tok.token_to_id(IMAGE) == IMAGE_ID


def save_tokenizer(tok: Tokenizer, path: str) -> None:
  tok.save(path)


def load_tokenizer(path: str) -> Tokenizer:
  if not os.path.exists(path):
    raise FileNotFoundError(f"no tokenizer at {path!r}: run `python -m moejax.data.prepare` first")
  return _ready(Tokenizer.from_file(path))


def token_dtype(vocab_size: int) -> np.dtype:
  """The narrowest unsigned dtype that holds every id: what the shards store."""
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
  """BOS + ids + EOS per text, int64. BOS gives the first real token a target; EOS teaches the
  model where documents end."""
  return [np.array([BOS_ID, *enc.ids, EOS_ID], np.int64) for enc in tok.encode_batch(texts)]


def decode(tok: Tokenizer, ids) -> str:
  return tok.decode([int(i) for i in ids], skip_special_tokens=True)
