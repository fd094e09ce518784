"""Loss by position: does a model's loss keep falling deeper into a document, up to and past the length
it was trained at?

Documents of the run's validation split with at least L + 1 tokens, each cut to its first L + 1
(inputs and next-token targets), are scored through the prefill path (moejax.evaluation.scoring); the
per-position losses are averaged overall and in buckets of positions whose edges double: [0, 64),
[64, 128), ..., up to L. Every bucket averages the same documents, so the buckets compare positions,
not documents.
"""

import numpy as np
from grain.sources import ArrayRecordDataSource

from moejax.data.config import is_synthetic
from moejax.data.prepare import load_manifest, prepare, shard_paths
from moejax.evaluation.scoring import score_rows

FIRST_EDGE = 64


def bucket_edges(length: int, first: int = FIRST_EDGE) -> list[int]:
  """0, first, 2*first, ... , length: the bucket edges of positions [0, length)."""
  if length < 1:
    raise ValueError(f"length must be >= 1, got {length}")
  edges, edge = [0], first
  while edge < length:
    edges.append(edge)
    edge *= 2
  return edges + [length]


def bucket_sums(nll_BT: np.ndarray, lengths_B: np.ndarray, edges: list[int]) -> tuple[np.ndarray, np.ndarray]:
  """(sums [buckets] float64, counts [buckets]) of nll over the rows' real positions (those below each
  row's length) in each bucket [edges[i], edges[i + 1])."""
  real_BT = np.arange(nll_BT.shape[1])[None, :] < np.asarray(lengths_B)[:, None]
  nll_BT = np.where(real_BT, nll_BT, 0.0).astype(np.float64)
  sums = np.array([nll_BT[:, s:e].sum() for s, e in zip(edges[:-1], edges[1:], strict=True)])
  counts = np.array([int(real_BT[:, s:e].sum()) for s, e in zip(edges[:-1], edges[1:], strict=True)])
  return sums, counts


def bucket_means(sums: np.ndarray, counts: np.ndarray, edges: list[int]) -> list[dict]:
  """Per bucket [start, end): the mean loss of `bucket_sums` (None where it has no position) and the
  count."""
  return [{"start": s, "end": e, "tokens": int(n), "loss": float(t / n) if n else None}
          for s, e, n, t in zip(edges[:-1], edges[1:], counts, sums, strict=True)]


def validation_documents(config, min_tokens: int, limit: int | None = None) -> list[np.ndarray]:
  """Token ids (BOS..EOS) of the validation documents with at least `min_tokens` ids, in split order; at
  most `limit`. Prepares the run's corpus if its cache is gone (the same bytes: the data pin)."""
  if is_synthetic(config.data):
    raise ValueError(f"data.source={config.data.source!r} has no documents: loss by position needs a run "
                     "trained on a corpus")
  manifest_path = prepare(config.data)
  dtype = np.dtype(load_manifest(manifest_path)["token_dtype"]).newbyteorder("<")
  source = ArrayRecordDataSource(shard_paths(manifest_path, "validation"))
  docs = []
  for i in range(len(source)):
    ids = np.frombuffer(source[i], dtype).astype(np.int32)
    if len(ids) >= min_tokens:
      docs.append(ids)
      if limit is not None and len(docs) >= limit:
        break
  return docs


def loss_by_position(lm, documents: list[np.ndarray], length: int, *, batch: int = 8,
                     piece: int | None = None) -> dict:
  """{"length", "documents", "tokens", "loss", "buckets": bucket_means} of the documents' first `length`
  next-token predictions (documents shorter than length + 1 ids are refused: every bucket must average
  the same documents)."""
  short = [len(d) for d in documents if len(d) < length + 1]
  if short:
    raise ValueError(f"{len(short)} documents are shorter than length + 1 = {length + 1} ids")
  edges = bucket_edges(length)
  sums = np.zeros(len(edges) - 1)
  counts = np.zeros(len(edges) - 1, np.int64)
  for at in range(0, len(documents), batch):
    rows = np.stack([d[:length + 1] for d in documents[at:at + batch]])
    scores = score_rows(lm, rows[:, :-1], rows[:, 1:], piece=piece)
    row_sums, row_counts = bucket_sums(scores.nll_BT, np.full(len(rows), length), edges)
    sums += row_sums
    counts += row_counts
  buckets = bucket_means(sums, counts, edges)
  total = int(counts.sum())
  return {"length": length, "documents": len(documents), "tokens": total,
          "loss": float(sums.sum() / total) if total else None, "buckets": buckets}
