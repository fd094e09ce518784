"""The training step with images: experiments/h200.py with a ~100M-parameter vision tower, next to the
text-only step, in the same call.

python -m benchmarks.vision [--config experiments/h200.py] [--out BENCHMARKS.md] [--smoke]

- Text-only: the config's train step (`moejax.training.step.jit_train_step`, timed by benchmarks/step.py's
  `time_steps`) on `synthetic_batch` (benchmarks/step_setup.py) of its first stage's shape: uniform random
  tokens packed into documents of mean length --mean-doc.
- Vision: the same config and batch shape (rows of the same T, the same passes) with `model.vision` on and
  the tower below. Each row packs images of random native size (each side drawn uniformly from 224..672
  pixels, so both aspect ratios; random pixels) until --patches-per-row is full or three draws in a row do
  not fit: each image is an example of BOS, its placeholders (one per merged image token) and a random
  caption of 8..120 tokens; plain text documents fill the rest of the row. The batch is made by the real
  functions (`patchify` -> `pack_images`), with segment ids per example and `loss_mask` 0 where the target
  is a placeholder, as moejax/vision/pipeline.py packs rows; no data is read (`data.images.source` is
  "embedded" only because validation asks for a source).

The tower: width 768, depth 12, 12 heads (of 64), MLP 3072, i.e. ViT-B's shape, 85M parameters in its
blocks, plus the patch embedding, the position table and the projector (3072 -> d_model -> d_model): about
90M in all. Patch 14 with a 2 x 2 merge (MoonViT's and Qwen2-VL's) makes each decoder token 28 x 28 pixels;
the 32 x 32 position table covers a 448-pixel side, the middle of the drawn sizes (16..48 patches a side),
so it is resampled both up and down. --patches-per-row 4096 (at most 1,024 image tokens, an eighth of an
8K row; about three images a row) keeps the tower's activations, at h200.py's remat "none", within the
card beside the decoder's.

FLOPs of a step (3 x forward, the backward counted as twice the forward; rematerialisation not counted):

  decoder = model_flops_per_token(config, params without "vision", segment_ids) x B x T
            (benchmarks/step_setup.py: 2 per active matmul weight per position, image positions included,
            plus the KDA chunked form and MLA's causal attention within the documents of the batch)
  encoder = 3 x [ 2 x (tower matmul weights: the patch embedding and the blocks' kernels; the position
                       table, a gather, and the biases and norms not) x real patches
                + depth x 2 x 2 x (sum over images of n_i^2) x width
                       (QK^T and PV, bidirectional within each image of n_i patches: the pairs the
                       document-attention kernel computes; none across images, none on padding patches)
                + 2 x (projector kernels) x merged image tokens ]

`model_flops_per_token` counts every >= 2-D param as a per-position matmul, which the tower's params are
not (they act per patch): it is given the params without the "vision" subtree, and the run checks that
the vision step's decoder count equals the text step's. The patch embedding's input gradient is never
computed (the input is pixels), so 3 x overcounts its 0.45M weights a little.

MFU = (decoder + encoder FLOPs per step) / step time, against the card's data-sheet dense bf16 peak and
against the bf16 matmul rate measured in the same call (benchmarks/timing.py). The run fits a 600-second
device call on one H100 or H200 (its compiles and peak memory: BENCHMARKS.md, "Vision step").
"""

import argparse
import os
import pathlib

import jax
import numpy as np

from benchmarks.report import provenance, publish
from benchmarks.step import XLA_FLAGS, time_steps
from benchmarks.step_setup import (
  abstract_state,
  load_config,
  log,
  make_mesh,
  model_flops_per_token,
  peak_memory_bytes,
  synthetic_batch,
)
from benchmarks.timing import matmul_rate, spec_bf16_peak
from moejax.config import passes_per_step, validate
from moejax.data.tokenizer import BOS_ID, EOS_ID, IMAGE_ID
from moejax.device_memory import is_out_of_memory, use_default_memory_fraction
from moejax.model import build_model
from moejax.vision.config import image_pixel_cap
from moejax.vision.patches import merged_tokens, num_patches, patchify
from moejax.vision.pipeline import pack_row, row_shape

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTION = "Vision step"
TOWER = {"patch_size": 14, "merge": 2, "width": 768, "depth": 12, "num_heads": 12, "mlp_dim": 3072,
         "position_grid": 32}
SIDES = (224, 672)  # pixels a side of the drawn images, each side uniform in [lo, hi]
PATCHES_PER_ROW = 4096
SMOKE_TOWER = {"patch_size": 4, "merge": 2, "width": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64,
               "position_grid": 8}
SMOKE_SIDES = (8, 24)
SMOKE_PATCHES_PER_ROW = 64
CAPTION = (8, 120)  # tokens of an image's random caption, uniform in [lo, hi]
MISSES = 3  # a row stops taking images after this many draws in a row that do not fit


def vision_config(path: str, overrides: list[str], smoke: bool, patches_per_row: int):
  """The text config with the tower (TOWER, or SMOKE_TOWER) and images in the rows, validated."""
  config = load_config(path, overrides, smoke)
  config.model.vision.update(enabled=True, **(SMOKE_TOWER if smoke else TOWER))
  config.data.image_token = True
  config.data.images.source = "embedded"  # validation wants a source; the benchmark reads no data
  config.data.images.patches_per_row = patches_per_row
  return validate(config)


def vision_row(rng, config, seq_len: int, mean_doc: int, sides: tuple[int, int]) -> dict:
  """One packed row: images of random size (each an example of BOS, its placeholders, a random caption,
  EOS), then random text documents of mean length `mean_doc` to the row's end."""
  v, capacity = config.model.vision, config.data.images.patches_per_row
  size = dict(patch=v.patch_size, merge=v.merge, max_pixels=image_pixel_cap(config))
  text = lambda n: rng.integers(IMAGE_ID + 1, config.model.vocab_size, n, dtype=np.int32)
  items, patch_counts, patches_used, positions_used, misses = [], [], 0, 0, 0
  while misses < MISSES:
    h, w = (int(s) for s in rng.integers(sides[0], sides[1] + 1, 2))
    n = num_patches(h, w, **size)
    k, caption = merged_tokens(n, v.merge), int(rng.integers(CAPTION[0], CAPTION[1] + 1))
    # BOS, k placeholders, the caption, EOS: k + caption + 1 positions
    if patches_used + n > capacity or positions_used + k + caption + 1 > seq_len:
      misses += 1
      continue
    misses = 0
    patches, coords = patchify(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), **size)
    assert len(patches) == n
    items.append({"ids": np.array([BOS_ID, *[IMAGE_ID] * k, *text(caption), EOS_ID], np.int32),
                  "patches": patches, "coords": coords})
    patch_counts.append(n)
    patches_used, positions_used = patches_used + n, positions_used + k + caption + 1
  while positions_used < seq_len:  # plain text documents; the last is cut at the row's end
    length = min(int(rng.geometric(1.0 / max(mean_doc, 1))), seq_len - positions_used)
    items.append({"ids": np.array([BOS_ID, *text(length - 1), EOS_ID], np.int32)})
    positions_used += length
  row = pack_row(items, row_shape(config, seq_len))
  assert int(np.sum(row["segment_ids"] > 0)) == seq_len  # the row is full
  placeholders = int(np.sum(row["tokens"] == IMAGE_ID))
  image_tokens = int(np.sum(row["image_ids"] > 0)) // v.merge ** 2
  assert placeholders == image_tokens, (placeholders, image_tokens)
  return {**row, "patch_counts": patch_counts}


def vision_batch(config, batch: int, seq_len: int, mean_doc: int, sides, seed: int = 0):
  """(the batch of `batch` rows, the patch count of each of its images)."""
  rng = np.random.default_rng(seed)
  rows = [vision_row(rng, config, seq_len, mean_doc, sides) for _ in range(batch)]
  counts = [n for row in rows for n in row.pop("patch_counts")]
  return {k: np.stack([row[k] for row in rows]) for k in rows[0]}, counts


def decoder_flops_per_token(config, params, segment_ids) -> dict:
  """model_flops_per_token of the params without the tower: it counts every >= 2-D param as a matmul
  at every position, which the tower's (per patch) are not."""
  decoder = {k: v for k, v in params.items() if k != "vision"}
  return model_flops_per_token(config, decoder, segment_ids)


def tower_weights(vision_params) -> dict:
  """The tower's parameter counts: its matmul kernels (patch embedding and blocks), the projector's
  kernels, the position table, and the rest (biases, norms)."""
  out = {"tower kernels": 0, "projector kernels": 0, "position table": 0, "biases and norms": 0}
  for path, leaf in jax.tree_util.tree_flatten_with_path(vision_params)[0]:
    keys = [str(getattr(k, "key", k)) for k in path]
    if keys[-1] == "kernel":
      out["projector kernels" if keys[0].startswith("projector_") else "tower kernels"] += leaf.size
    elif keys[-1] == "position_table":
      out["position table"] += leaf.size
    elif keys[-1] in ("bias", "scale"):
      out["biases and norms"] += leaf.size
    else:
      raise ValueError(f"tower param {'/'.join(keys)} is of no kind this count knows")
  return out


def encoder_flops(v, weights: dict, patch_counts) -> dict:
  """Training FLOPs of the tower on images of `patch_counts` patches (3 x forward; module docstring)."""
  n = np.asarray(patch_counts, np.float64)
  parts = {"tower matmuls": 3 * 2 * weights["tower kernels"] * n.sum(),
           "tower attention": 3 * v.depth * 2 * 2 * np.sum(n * n) * v.width,
           "projector": 3 * 2 * weights["projector kernels"] * n.sum() / v.merge ** 2}
  return {**parts, "total": sum(parts.values())}


def timed(config, batch, steps: int, mesh) -> dict:
  """time_steps' step time, compile time and loss, and the peak memory after it; the state is dropped,
  so that the next step has the card."""
  try:
    r = time_steps(config, batch, steps, mesh)
  except Exception as e:
    if not is_out_of_memory(e):
      raise
    log(f"out of memory: {str(e).splitlines()[0][:200]}")
    return {"failed": "out of memory"}
  out = {k: r[k] for k in ("step_s", "compile_s", "loss")}
  del r
  return {**out, "peak_bytes": peak_memory_bytes()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(ROOT / "experiments" / "h200.py"))
  parser.add_argument("--set", action="append", default=[], help="config override, e.g. model.remat=full")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--mean-doc", type=int, default=2048, help="mean length of the text documents")
  parser.add_argument("--patches-per-row", type=int, default=None,
                      help=f"a row's image budget (default {PATCHES_PER_ROW}; smoke {SMOKE_PATCHES_PER_ROW})")
  parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
  parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU); prints, writes no table")
  args = parser.parse_args()
  # Before the backend starts: cuBLAS for the dense matmuls and the memory the train step gets, as
  # benchmarks/step.py runs it (it says why), and parameters drawn with the RBG generator on the host.
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), XLA_FLAGS])
  use_default_memory_fraction()
  jax.config.update("jax_default_prng_impl", "rbg")
  if args.smoke:
    args.steps, args.mean_doc = min(args.steps, 2), 100
  elif jax.default_backend() != "gpu":
    raise SystemExit("benchmarks/vision.py times the step on a GPU; use --smoke on the CPU")
  per_row = args.patches_per_row or (SMOKE_PATCHES_PER_ROW if args.smoke else PATCHES_PER_ROW)
  sides = SMOKE_SIDES if args.smoke else SIDES

  text_config = load_config(args.config, args.set, args.smoke)
  config = vision_config(args.config, args.set, args.smoke, per_row)
  seq_len, _, tokens = text_config.train.stages[0]
  rows = tokens // seq_len
  passes = passes_per_step(seq_len, tokens, text_config.train.microbatch_tokens)
  text_batch = synthetic_batch(text_config, rows, seq_len, args.mean_doc)
  log(f"packing {rows} rows of {seq_len} tokens and up to {per_row} patches of images {sides[0]}..{sides[1]} "
      "pixels a side")
  batch, counts = vision_batch(config, rows, seq_len, args.mean_doc, sides)
  v = config.model.vision
  image_tokens = sum(counts) // v.merge ** 2
  text_positions = tokens - image_tokens

  # FLOPs from the params' shapes, before anything is timed.
  text_params = abstract_state(build_model(text_config), text_config)[0].params
  vision_params = abstract_state(build_model(config), config)[0].params
  text_flops = decoder_flops_per_token(text_config, text_params, text_batch["segment_ids"])
  decoder = decoder_flops_per_token(config, vision_params, batch["segment_ids"])
  with_tower = model_flops_per_token(config, vision_params, batch["segment_ids"])
  weights = tower_weights(vision_params["vision"])
  tower_params = sum(weights.values())
  if decoder["matmul weights"] != text_flops["matmul weights"]:
    raise AssertionError(f"the vision decoder's matmul FLOPs/token {decoder['matmul weights']:.4g} are not "
                         f"the text decoder's {text_flops['matmul weights']:.4g}: the tower leaked in")
  assert with_tower["matmul weights"] > decoder["matmul weights"]  # what leaving the tower out avoids
  encoder = encoder_flops(v, weights, counts)
  log(f"tower {tower_params / 1e6:.3g}M params; {len(counts)} images, {sum(counts):,} of {rows * per_row:,} "
      f"patch slots, {image_tokens:,} image tokens of {tokens:,} positions; encoder "
      f"{encoder['total'] / 1e12:.3f} TFLOP a step, decoder {decoder['total'] * tokens / 1e12:.3f}")

  device = jax.devices()[0].device_kind
  matmul_n = 512 if args.smoke else 8192
  rate = matmul_rate(matmul_n)
  spec = spec_bf16_peak(device)
  log(f"{device}: bf16 matmul rate {rate / 1e12:.1f} TFLOP/s")
  mesh = make_mesh({})
  results = {"text-only": timed(text_config, text_batch, args.steps, mesh)}
  log(f"text-only step: {results['text-only']}")
  results["vision"] = timed(config, batch, args.steps, mesh)
  log(f"vision step: {results['vision']}")

  tflop = lambda x: f"{x / 1e12:.4g}" if x else "-"
  millions = lambda n: f"{n / 1e6:.3g}M"
  figures = {"text-only": (text_flops["total"] * tokens, 0.0, 0, tokens),
             "vision": (decoder["total"] * tokens, encoder["total"], len(counts), text_positions)}
  text_s = results["text-only"].get("step_s")
  lines = provenance(device) + [
      f"`{pathlib.Path(args.config).name}` at its first stage's shape, {rows} rows of {seq_len:,} tokens "
      f"({passes} pass{'es' if passes > 1 else ''} of {tokens // passes:,} tokens), one device, {args.steps} "
      f"timed steps each, both in this call. Text-only: synthetic packed documents (mean length "
      f"{args.mean_doc}). Vision: the same with a tower of {millions(tower_params)} params "
      f"(width {v.width}, depth {v.depth}, {v.num_heads} heads, MLP {v.mlp_dim}, patch {v.patch_size}, "
      f"merge {v.merge}, position grid {v.position_grid}; {millions(weights['tower kernels'])} in matmuls, "
      f"projector {millions(weights['projector kernels'])}) and rows of {len(counts) / rows:.1f} images on "
      f"average, random sides {sides[0]}..{sides[1]} px: {len(counts)} images, {sum(counts):,} patches in "
      f"{rows * per_row:,} slots ({per_row:,} a row), {image_tokens:,} image tokens "
      f"({image_tokens / tokens:.1%} of the positions), the rest captions and text documents.",
      "",
      "FLOPs per step, decoder: model_flops_per_token (params without the tower; it checked equal to the "
      "text step's matmul count) x positions; encoder: 3 x (2 x tower matmul weights x real patches + "
      "depth x 4 x sum of n_i^2 x width + 2 x projector weights x image tokens) (benchmarks/vision.py). "
      f"MFU against the spec dense bf16 peak ({'n/a' if spec is None else f'{spec / 1e12:.1f}'} TFLOP/s) "
      f"and against the bf16 matmul rate measured in this call ({rate / 1e12:.1f} TFLOP/s, XLA "
      f"{matmul_n}^3).", "",
      "| step | step ms | tokens/s (all positions) | tokens/s (text positions) | images/s | decoder TFLOP "
      "| encoder TFLOP | MFU (spec peak) | MFU (measured matmul) | time / text step |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for name, r in results.items():
    dec, enc, images, text = figures[name]
    if "failed" in r:
      lines.append(f"| {name} | {r['failed']} | | | | {tflop(dec)} | {tflop(enc)} | | | |")
      continue
    s = r["step_s"]
    mfu_spec = "n/a" if spec is None else f"{(dec + enc) / s / spec:.1%}"
    ratio = f"{s / text_s:.2f}" if text_s else "n/a"
    per_s = f"{images / s:,.1f}" if images else "-"
    lines.append(f"| {name} | {s * 1e3:.1f} | {tokens / s:,.0f} | {text / s:,.0f} | {per_s} | {tflop(dec)} "
                 f"| {tflop(enc)} | {mfu_spec} | {(dec + enc) / s / rate:.1%} | {ratio} |")
  gib = lambda b: "n/a" if b is None else f"{b / 2**30:.1f} GiB"
  lines += ["", "Encoder TFLOP by part: " + ", ".join(f"{k} {tflop(x)}" for k, x in encoder.items()
                                                      if k != "total") + ".  ",
            "Compile, loss, peak memory (the process's, so the vision step's is the larger of the two): "
            + "; ".join(f"{name} " + (r["failed"] if "failed" in r else
                                      f"{r['compile_s']:.0f} s, {r['loss']:.3f}, {gib(r['peak_bytes'])}")
                        for name, r in results.items()) + "."]
  publish(None if args.smoke else args.out, SECTION, lines)


if __name__ == "__main__":
  main()
