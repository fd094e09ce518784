"""Multi-query associative recall at any length: the share of queries whose value a model predicts
greedily, on rows of the "test" split of moejax.data.mqar (never trained on), scored through the prefill
path (moejax.evaluation.scoring)."""

from moejax.data import mqar
from moejax.data.config import is_synthetic
from moejax.evaluation.scoring import score_rows


def mqar_accuracy(lm, length: int, *, examples: int = 64, batch: int = 16, seed: int = 0, mqar_config=None,
                  piece: int | None = None) -> dict:
  """{"length", "examples", "queries", "accuracy"} over `examples` rows of `length` tokens, drawn with the
  run's data.mqar settings (or `mqar_config`)."""
  c = mqar_config
  if c is None:
    if not is_synthetic(lm.config.data):
      raise ValueError("the model was not trained on MQAR rows (data.source is "
                       f"{lm.config.data.source!r}): pass mqar_config to say which keys and values to ask")
    c = lm.config.data.mqar
  mqar.validate_mqar(c, lm.vocab_size)
  if examples < 1:
    raise ValueError(f"examples must be >= 1, got {examples}")
  right = asked = 0
  for start in range(0, examples, batch):
    rows = mqar.batch(c, length, min(batch, examples - start), seed=seed, split="test", start=start)
    scores = score_rows(lm, rows["tokens"], rows["targets"], piece=piece)
    query = rows["loss_mask"] > 0
    right += int((scores.argmax_BT[query] == rows["targets"][query]).sum())
    asked += int(query.sum())
  return {"length": length, "examples": examples, "queries": asked, "accuracy": right / asked}
