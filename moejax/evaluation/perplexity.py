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


def bucket_means(nll_BT: np.ndarray, lengths_B: np.ndarray, edges: list[int]) -> list[dict]:
  """Per bucket [start, end): the mean of nll over the rows' real positions in it, and their count."""
  real_BT = np.arange(nll_BT.shape[1])[None, :] < np.asarray(lengths_B)[:, None]
  out = []
  for start, end in zip(edges[:-1], edges[1:], strict=True):
    n = int(real_BT[:, start:end].sum())
    total = float(np.where(real_BT[:, start:end], nll_BT[:, start:end], 0.0).sum(dtype=np.float64))
    out.append({"start": start, "end": end, "tokens": n, "loss": total / n if n else None})
  return out


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
    for k, b in enumerate(bucket_means(scores.nll_BT, np.full(len(rows), length), edges)):
      sums[k] += (b["loss"] or 0.0) * b["tokens"]
      counts[k] += b["tokens"]
  buckets = [{"start": s, "end": e, "tokens": int(n), "loss": float(t / n) if n else None}
             for s, e, n, t in zip(edges[:-1], edges[1:], counts, sums, strict=True)]
  total = int(counts.sum())
  return {"length": length, "documents": len(documents), "tokens": total,
          "loss": float(sums.sum() / total) if total else None, "buckets": buckets}
