"""Tiny vision-language model for CPU: captions scikit-learn's digits and drawn scenes in minutes.

python -m moejax.train --config experiments/vision_tiny.py --workdir runs/vision_tiny
python -m moejax.evaluate --workdir runs/vision_tiny --task captions

The decoder is experiments/tiny.py's; the tower cuts 4x4-pixel patches (a 16-pixel digit is 4x4 patches,
4 decoder tokens after the 2x2 merge; a scene of 32..48 pixels a side, 16..36 tokens). Rows pack image
captions with a tenth as many windows of the stdlib text corpus.
"""

import pathlib

from moejax.config import load_experiment


def get_config():
  c = load_experiment(pathlib.Path(__file__).with_name("tiny.py"))
  c.data.image_token = True
  v = c.model.vision
  v.enabled = True
  v.patch_size = 4
  v.merge = 2
  v.max_pixels = 48 * 48
  v.width = 64
  v.depth = 3
  v.num_heads = 4
  v.mlp_dim = 128
  v.position_grid = 12
  images = c.data.images
  images.source = "embedded"
  # Digits are learnt in a few hundred steps; scenes need more of the rows.
  images.digits_weight = 0.5
  images.scenes_weight = 2.5
  images.text_weight = 0.1
  images.scene_min_side, images.scene_max_side = 32, 48
  images.scene_min_object = 8  # two 4x4 patches across at the least
  images.patches_per_row = 256
  c.optim.warmup_steps = 30
  c.train.stages = ((128, 1100, 4096),)
  c.train.eval_every = 550
  c.train.checkpoint_every = 550
  return c
