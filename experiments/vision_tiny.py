"""Tiny vision-language model for CPU: captions scikit-learn's digits and drawn scenes in minutes.

python -m moejax.train --config experiments/vision_tiny.py --workdir runs/vision_tiny
python -m moejax.evaluate --workdir runs/vision_tiny --task captions

The decoder is experiments/tiny.py's; the tower cuts 4x4-pixel patches (a 16-pixel digit is 4x4 patches,
4 decoder tokens after the 2x2 merge; a scene of 24..48 pixels a side, 9..36 tokens). Rows pack image
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
  images.digits_weight = 1.0
  images.scenes_weight = 2.0
  images.text_weight = 0.1
  images.patches_per_row = 256
  c.optim.warmup_steps = 30
  c.train.stages = ((128, 600, 4096),)
  c.train.eval_every = 200
  c.train.checkpoint_every = 200
  return c
