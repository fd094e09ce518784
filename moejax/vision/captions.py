"""Greedy captions of held-out images, scored by what they must state.

A digit caption is right when it names the right digit and no other (`digit_caption_correct`); a scene
caption when it states its shape, colour, count and position right and no other value of any
(`scene_caption_correct`). The held-out images are the digits' "valid" split and the first
data.images.valid_scenes scenes of the scenes' "valid" stream, none of which training reads.
"""

import numpy as np

from moejax.data.tokenizer import BOS_ID, IMAGE_ID
from moejax.vision.digits import digit_caption_correct, digit_examples
from moejax.vision.scenes import scene_at, scene_caption_correct

_CORRECT = {"digits": digit_caption_correct, "scenes": scene_caption_correct}


def held_out_examples(config, limit: int | None = None) -> list:
  """The held-out digits and scenes (at most `limit` of each)."""
  images = config.data.images
  digits = digit_examples("valid", size=images.digit_size)[:limit]
  n = images.valid_scenes if limit is None else min(limit, images.valid_scenes)
  scenes = [scene_at("valid", i, min_side=images.scene_min_side, max_side=images.scene_max_side,
                     min_object=images.scene_min_object)
            for i in range(n)]
  return digits + scenes


def caption(lm, images: list[np.ndarray], *, batch: int = 64, max_new_tokens: int = 24) -> list[str]:
  """Greedy captions: each image alone after BOS, decoded until EOS or max_new_tokens."""
  from moejax.inference import generate  # inference imports the model: imported when captions are made

  texts = []
  for start in range(0, len(images), batch):
    chunk = images[start:start + batch]
    out = generate(lm, [[BOS_ID, IMAGE_ID]] * len(chunk), images=[[im] for im in chunk],
                   max_new_tokens=max_new_tokens, eos_id=lm.tokenizer.eos_id)
    texts += [lm.tokenizer.decode(tokens) for tokens in out.tokens]
  return texts


def caption_accuracy(lm, examples, *, batch: int = 64) -> tuple[dict, list[dict]]:
  """({"digits_accuracy", "shapes_accuracy", "digits", "scenes"}, one record per example: kind, label,
  caption, right)."""
  texts = caption(lm, [e.image for e in examples], batch=batch)
  records = [{"kind": e.kind, "label": e.label, "caption": t, "right": bool(_CORRECT[e.kind](t, e.label))}
             for e, t in zip(examples, texts, strict=True)]
  score = lambda kind: [r["right"] for r in records if r["kind"] == kind]
  summary = {"digits_accuracy": float(np.mean(score("digits"))) if score("digits") else None,
             "shapes_accuracy": float(np.mean(score("scenes"))) if score("scenes") else None,
             "digits": len(score("digits")), "scenes": len(score("scenes"))}
  return summary, records
