"""Text from a trained model, on the command line.

python -m moejax.generate --workdir runs/tiny --prompt "def fib(n):" --max-new-tokens 64
python -m moejax.generate --workdir runs/tiny --prompts-file prompts.jsonl --output replies.jsonl
python -m moejax.generate --workdir runs/tiny --interactive
python -m moejax.generate --workdir runs/vision_tiny --image digit.png --prompt ""

One prompt streams its text as it is drawn. A prompts file (JSONL, one {"prompt": "..."} a line) runs
as one batch and writes one JSON line per prompt: prompt, text, tokens, logprobs, finish_reason.
--interactive keeps a conversation: each line typed is a turn, fed after everything before it, whose
caches are kept (only the new text is prefilled). Generation stops at the tokenizer's EOS unless
--ignore-eos. Greedy unless --temperature > 0. With a vision model, --image PATH (repeatable) puts the
images before the prompt's text, and a prompts file's lines may carry "images": [paths] likewise.
"""

import argparse
import json
import os
import sys

from moejax.device_memory import use_default_memory_fraction


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m moejax.generate", description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a training run's workdir (relative or absolute)")
  p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--prompt", help="one prompt, whose reply is streamed")
  source.add_argument("--prompts-file", help='JSONL of {"prompt": "..."}: one batch')
  source.add_argument("--interactive", action="store_true", help="a conversation read from stdin")
  p.add_argument("--image", action="append", default=[],
                 help="an image (local path or fsspec URL) put before the prompt; repeat for more")
  p.add_argument("--output", default="-", help="where --prompts-file writes its JSONL (default: stdout)")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--cache-len", type=int, default=None,
                 help="tokens a row may hold in all (default: inference.cache_len of the run)")
  p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's EOS")
  return p


class _TextStream:
  """Prints the text of a growing token list as it becomes whole characters: byte-level tokens may
  split a UTF-8 character, whose decoding waits for the rest of it."""

  def __init__(self, tokenizer, out):
    self.tokenizer, self.out, self.ids, self.shown = tokenizer, out, [], 0

  def add(self, ids) -> None:
    self.ids += list(ids)
    text = self.tokenizer.decode(self.ids)
    if text.endswith("\ufffd"):
      return
    self.out.write(text[self.shown:])
    self.out.flush()
    self.shown = len(text)


def _sampling(args) -> dict:
  return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
          "top_p": args.top_p}


def _with_images(lm, text: str, paths: list[str]) -> tuple[list[int], list]:
  """(the prompt's ids with one image placeholder per image after its BOS, the decoded images)."""
  from moejax.data.tokenizer import IMAGE_ID
  from moejax.vision.images import BadImage, read_image

  ids = lm.tokenizer.encode(text)
  if not paths:
    return ids, []
  if not lm.config.model.vision.enabled:
    raise SystemExit("--image: the model of this run has no vision tower (model.vision.enabled is False)")
  images = []
  for path in paths:
    try:
      images.append(read_image(path, max_decode_pixels=lm.config.data.images.max_decode_pixels))
    except BadImage as e:
      raise SystemExit(f"--image {path}: {e.reason} image ({e.detail})") from None
  return ids[:1] + [IMAGE_ID] * len(images) + ids[1:], images


def _read_prompts(path: str) -> list[tuple[str, list[str]]]:
  prompts = []
  if not os.path.isfile(path):
    raise SystemExit(f"no prompts file at {path}")
  with open(path) as f:
    for i, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise SystemExit(f"{path}:{i}: not JSON ({e})") from None
      if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise SystemExit(f'{path}:{i}: each line must be an object with a "prompt" string')
      images = record.get("images", [])
      if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise SystemExit(f'{path}:{i}: "images" must be a list of image paths')
      prompts.append((record["prompt"], images))
  if not prompts:
    raise SystemExit(f"{path}: no prompts")
  return prompts


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  from moejax.inference import Conversation, generate, load_model  # after the memory setting

  lm = load_model(args.workdir, args.step, cache_len=args.cache_len)
  tok = lm.tokenizer
  eos_id = None if args.ignore_eos else tok.eos_id
  if args.prompt is not None:
    stream = _TextStream(tok, sys.stdout)
    conversation = Conversation(lm, 1, seed=args.seed)
    ids, images = _with_images(lm, args.prompt, args.image)
    out = conversation.turn([ids], eos_id=eos_id, images=[images] if images else None,
                            on_tokens=lambda rows: stream.add(rows[0]), **_sampling(args))
    sys.stdout.write("\n")
    print(f"[{len(out.tokens[0])} tokens, {out.finish_reasons[0]}]", file=sys.stderr)
  elif args.prompts_file is not None:
    if args.image:
      raise SystemExit('--image goes with --prompt; a prompts file names its images per line ("images")')
    prompts = _read_prompts(args.prompts_file)
    rows = [_with_images(lm, text, paths) for text, paths in prompts]
    images = [im for _, im in rows] if any(im for _, im in rows) else None
    out = generate(lm, [ids for ids, _ in rows], eos_id=eos_id, seed=args.seed, images=images,
                   **_sampling(args))
    prompts = [text for text, _ in prompts]
    sink = sys.stdout if args.output == "-" else open(args.output, "w")  # noqa: SIM115 - closed below
    try:
      for prompt, tokens, logprobs, reason in zip(prompts, out.tokens, out.logprobs, out.finish_reasons,
                                                  strict=True):
        sink.write(json.dumps({"prompt": prompt, "text": tok.decode(tokens), "tokens": tokens,
                               "logprobs": logprobs, "finish_reason": reason}) + "\n")
    finally:
      if sink is not sys.stdout:
        sink.close()
  else:
    if args.image:
      raise SystemExit("--image goes with --prompt")
    conversation = Conversation(lm, 1, seed=args.seed)
    first = True
    print("moejax: a conversation; each line is a turn, Ctrl-D ends it.", file=sys.stderr)
    for line in sys.stdin:
      text = line.rstrip("\n")
      stream = _TextStream(tok, sys.stdout)
      try:
        conversation.turn([tok.encode(text if first else "\n" + text, bos=first)], eos_id=eos_id,
                          on_tokens=lambda rows, stream=stream: stream.add(rows[0]), **_sampling(args))
      except ValueError as e:  # the cache is full: the conversation cannot go on
        print(f"\nmoejax: {e}", file=sys.stderr)
        return 1
      first = False
      sys.stdout.write("\n")
      sys.stdout.flush()
  return 0


if __name__ == "__main__":
  use_default_memory_fraction()
  try:
    sys.exit(main())
  except (ValueError, FileNotFoundError) as e:  # what the run cannot do: its reason, without a traceback
    sys.exit(f"python -m moejax.generate: {e}")
