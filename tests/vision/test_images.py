"""Image decoding and image-text pairs: every format and mode Pillow writes comes back as the right uint8 RGB
pixels, turned upright by its EXIF orientation; truncated, garbage, empty, missing and oversized images are
told apart (the oversized ones from the header alone, without decoding); read_pairs yields the good pairs in
order, skips and counts the bad images with a logged warning each, and raises on malformed lines with their
line number."""

import io
import json
import logging
import struct
import time
import zlib

import fsspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from moejax.vision.examples import ImageText
from moejax.vision.images import BadImage, SkipLog, decode_image, read_image
from moejax.vision.pairs import list_pairs, read_pairs

BIG = 10**7  # a max_decode_pixels no test image comes near
RNG_IMAGE = np.random.default_rng(0).integers(0, 256, size=(12, 20, 3), dtype=np.uint8)


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
  buf = io.BytesIO()
  img.save(buf, fmt, **kw)
  return buf.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
  """A PNG whose header says width x height 1-bit grey, followed by only a few bytes of pixel data: opening
  it is instant, decoding it would fail (truncated) or take gigabytes."""
  def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
  ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
  return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
          + chunk(b"IEND", b""))


def _reason(data: bytes, max_decode_pixels: int = BIG) -> str:
  with pytest.raises(BadImage) as e:
    decode_image(data, max_decode_pixels=max_decode_pixels)
  return e.value.reason


# --- formats and modes ---


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "WEBP"])
def test_lossless_formats_decode_exactly(fmt):
  kw = {"lossless": True} if fmt == "WEBP" else {}
  out = decode_image(_encode(Image.fromarray(RNG_IMAGE), fmt, **kw), max_decode_pixels=BIG)
  assert out.dtype == np.uint8 and out.shape == (12, 20, 3)
  np.testing.assert_array_equal(out, RNG_IMAGE)


def test_jpeg_decodes_close():
  blocks = np.zeros((32, 48, 3), np.uint8)
  blocks[:, :16] = (200, 30, 30)
  blocks[:, 16:32] = (30, 200, 30)
  blocks[:, 32:] = (30, 30, 200)
  out = decode_image(_encode(Image.fromarray(blocks), "JPEG", quality=95), max_decode_pixels=BIG)
  assert out.dtype == np.uint8 and out.shape == (32, 48, 3)
  assert np.abs(out.astype(int) - blocks).mean() < 4


def test_modes_convert_to_rgb():
  palette = Image.new("P", (3, 2))
  palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (256 * 3 - 9))
  palette.putdata([0, 1, 2, 2, 1, 0])
  want = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255]], [[0, 0, 255], [0, 255, 0], [255, 0, 0]]])
  for fmt in ("PNG", "GIF", "BMP"):
    np.testing.assert_array_equal(decode_image(_encode(palette, fmt), max_decode_pixels=BIG), want)

  grey = np.array([[0, 77, 255]], np.uint8)
  out = decode_image(_encode(Image.fromarray(grey, mode="L"), "PNG"), max_decode_pixels=BIG)
  np.testing.assert_array_equal(out, np.repeat(grey[:, :, None], 3, axis=2))

  bilevel = Image.new("1", (2, 1))
  bilevel.putdata([0, 1])
  out = decode_image(_encode(bilevel, "PNG"), max_decode_pixels=BIG)
  np.testing.assert_array_equal(out, [[[0, 0, 0], [255, 255, 255]]])

  cmyk = Image.new("CMYK", (2, 2), (0, 255, 255, 0))  # full magenta and yellow: red
  out = decode_image(_encode(cmyk, "TIFF"), max_decode_pixels=BIG)
  np.testing.assert_array_equal(out, [[[255, 0, 0]] * 2] * 2)
  out = decode_image(_encode(cmyk, "JPEG", quality=95), max_decode_pixels=BIG)
  assert out.shape == (2, 2, 3) and out[..., 0].min() > 200 and out[..., 1:].max() < 60

  deep = np.array([[0, 32768, 65535]], np.uint16)  # 16-bit grey is scaled, not clipped at 255
  out = decode_image(_encode(Image.fromarray(deep), "PNG"), max_decode_pixels=BIG)
  np.testing.assert_array_equal(out[0, :, 0], [0, 128, 255])
  assert (out == out[..., :1]).all()


def test_transparency_is_composited_on_white():
  rgba = np.array([[[255, 0, 0, 0], [0, 0, 255, 255], [0, 0, 0, 128]]], np.uint8)
  out = decode_image(_encode(Image.fromarray(rgba, mode="RGBA"), "PNG"), max_decode_pixels=BIG).astype(int)
  np.testing.assert_array_equal(out[0, :2], [[255, 255, 255], [0, 0, 255]])
  assert np.abs(out[0, 2] - 127).max() <= 1  # half black over white

  la = Image.fromarray(np.array([[[10, 0], [10, 255]]], np.uint8), mode="LA")
  np.testing.assert_array_equal(decode_image(_encode(la, "PNG"), max_decode_pixels=BIG),
                                [[[255, 255, 255], [10, 10, 10]]])

  palette = Image.new("P", (2, 1))
  palette.putpalette([0, 0, 0, 0, 255, 0] + [0] * (254 * 3))
  palette.putdata([0, 1])
  for fmt in ("PNG", "GIF"):
    out = decode_image(_encode(palette, fmt, transparency=0), max_decode_pixels=BIG)
    np.testing.assert_array_equal(out, [[[255, 255, 255], [0, 255, 0]]])


@pytest.mark.parametrize(("orientation", "upright"), [
    (1, lambda a: a),
    (2, np.fliplr),
    (3, lambda a: np.rot90(a, 2)),
    (6, lambda a: np.rot90(a, -1)),  # stored turned left: displayed turned a quarter clockwise
    (8, lambda a: np.rot90(a, 1)),
])
def test_exif_orientation_is_applied(orientation, upright):
  exif = Image.Exif()
  exif[0x0112] = orientation
  out = decode_image(_encode(Image.fromarray(RNG_IMAGE), "PNG", exif=exif), max_decode_pixels=BIG)
  np.testing.assert_array_equal(out, upright(RNG_IMAGE))


def test_exif_orientation_of_a_jpeg():
  stored = np.full((16, 48, 3), 240, np.uint8)
  stored[:, :16] = (200, 30, 30)  # red on the stored left: on top once turned a quarter clockwise
  exif = Image.Exif()
  exif[0x0112] = 6
  out = decode_image(_encode(Image.fromarray(stored), "JPEG", quality=95, exif=exif), max_decode_pixels=BIG)
  assert out.shape == (48, 16, 3)
  assert out[:12, :, 0].mean() > 180 and out[:12, :, 1].mean() < 60
  assert out[20:, :, 1].mean() > 200


# --- what is skipped, and why ---


def test_garbage_and_truncated_bytes_are_corrupt():
  png = _encode(Image.fromarray(RNG_IMAGE), "PNG")
  jpeg = _encode(Image.fromarray(RNG_IMAGE), "JPEG")
  assert _reason(b"not an image at all" * 10) == "corrupt"
  assert _reason(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40) == "corrupt"  # the signature and nothing sensible
  assert _reason(png[: len(png) // 2]) == "corrupt"
  assert _reason(jpeg[: len(jpeg) // 2]) == "corrupt"
  assert _reason(jpeg[:-2]) == "corrupt"
  assert _reason(png[:8]) == "corrupt"


def test_a_corrupt_pixel_stream_is_corrupt():
  png = bytearray(_encode(Image.fromarray(RNG_IMAGE), "PNG"))
  idat = png.index(b"IDAT")
  png[idat + 10: idat + 30] = b"\xff" * 20  # compressed pixels garbled, CRC now wrong too
  assert _reason(bytes(png)) == "corrupt"


def test_empty_bytes_are_empty():
  assert _reason(b"") == "empty"


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 400))
def test_any_prefix_of_a_png_is_bad_or_the_whole_image(cut):
  png = _encode(Image.fromarray(RNG_IMAGE), "PNG")
  try:
    out = decode_image(png[: cut % (len(png) + 1)], max_decode_pixels=BIG)
  except BadImage as e:
    assert e.reason in ("corrupt", "empty")
  else:
    np.testing.assert_array_equal(out, RNG_IMAGE)  # only the IEND chunk may be missing


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_never_crash(data):
  try:
    out = decode_image(data, max_decode_pixels=BIG)
  except BadImage as e:
    assert e.reason in ("corrupt", "empty")
  else:
    assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3


def test_oversized_at_exactly_the_limit():
  png = _encode(Image.fromarray(RNG_IMAGE), "PNG")  # 12 x 20 = 240 pixels
  assert decode_image(png, max_decode_pixels=240).shape == (12, 20, 3)
  assert _reason(png, max_decode_pixels=239) == "oversized"


def test_oversized_is_found_from_the_header_without_decoding(monkeypatch):
  blank = _encode(Image.new("1", (6000, 6000)), "PNG")  # 36 M pixels in a few kilobytes
  assert len(blank) < 100_000

  def no_decoding(self):
    raise AssertionError("the pixels were decoded")
  monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
  start = time.perf_counter()
  assert _reason(blank, max_decode_pixels=10_000) == "oversized"
  assert time.perf_counter() - start < 0.5
  # A header that claims 10^10 pixels, with almost no data behind it: oversized, not corrupt.
  assert _reason(_png_header_only(100_000, 100_000), max_decode_pixels=BIG) == "oversized"


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pillows_own_bomb_limit_is_oversized():
  limit = Image.MAX_IMAGE_PIXELS
  assert limit is not None
  above = _png_header_only(limit // 10_000 + 1, 10_000)  # Pillow warns
  far_above = _png_header_only(3 * limit // 10_000, 10_000)  # Pillow raises
  for data in (above, far_above):
    start = time.perf_counter()
    assert _reason(data, max_decode_pixels=10**12) == "oversized"
    assert time.perf_counter() - start < 0.5


def test_read_image_from_paths_and_urls(tmp_path):
  path = tmp_path / "a.png"
  path.write_bytes(_encode(Image.fromarray(RNG_IMAGE), "PNG"))
  np.testing.assert_array_equal(read_image(str(path), max_decode_pixels=BIG), RNG_IMAGE)
  np.testing.assert_array_equal(read_image(f"file://{path}", max_decode_pixels=BIG), RNG_IMAGE)
  url = "memory://moejax-test-images/a.png"
  with fsspec.open(url, "wb") as f:
    f.write(path.read_bytes())
  try:
    np.testing.assert_array_equal(read_image(url, max_decode_pixels=BIG), RNG_IMAGE)
  finally:
    fsspec.filesystem("memory").rm("/moejax-test-images", recursive=True)
  for missing in (tmp_path / "nope.png", tmp_path, "memory://moejax-test-images/nope.png"):
    with pytest.raises(BadImage, match="nope.png|is a directory|Directory") as e:
      read_image(str(missing), max_decode_pixels=BIG)
    assert e.value.reason == "missing"
  (tmp_path / "zero.png").write_bytes(b"")
  with pytest.raises(BadImage, match="zero.png") as e:
    read_image(str(tmp_path / "zero.png"), max_decode_pixels=BIG)
  assert e.value.reason == "empty"


def test_skip_log_counts_and_warns(caplog):
  skips = SkipLog()
  caplog.set_level(logging.WARNING, logger="moejax.vision")
  skips.skip("corrupt", "x.jsonl:3")
  skips.skip("missing", "x.jsonl:4")
  skips.skip("corrupt", "y.jsonl:1")
  assert skips.counts() == {"corrupt": 2, "missing": 1} and skips.total == 3
  messages = [r.getMessage() for r in caplog.records if r.name == "moejax.vision"]
  assert len(messages) == 3
  assert "y.jsonl:1" in messages[2] and "2 corrupt" in messages[2]
  with pytest.raises(ValueError, match="unknown skip reason"):
    skips.skip("ugly", "z")
  with pytest.raises(ValueError, match="unknown BadImage reason"):
    BadImage("ugly", "z")


def test_image_text_checks_and_freezes_its_image():
  image = np.zeros((2, 3, 3), np.uint8)
  ex = ImageText(image, "a caption.", "pairs", {})
  assert ex == ImageText(image.copy(), "a caption.", "pairs", {})
  assert ex != ImageText(image + 1, "a caption.", "pairs", {})
  with pytest.raises(ValueError, match="read-only"):
    ex.image[0, 0, 0] = 1
  for bad in (np.zeros((2, 3, 3), np.float32), np.zeros((2, 3), np.uint8), np.zeros((2, 3, 4), np.uint8),
              np.zeros((0, 3, 3), np.uint8)):
    with pytest.raises(ValueError, match="ImageText.image"):
      ImageText(bad, "x", "pairs", {})
  with pytest.raises(ValueError, match="kind"):
    ImageText(image, "x", "photos", {})


# --- image-text pairs ---


def _write_jsonl(path, records) -> None:
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


@pytest.fixture
def pairs_dir(tmp_path):
  """data/a.jsonl (one pair) and data/b.jsonl (two good images, four bad ones, a blank line), the images in
  data/img and, for the absolute path, elsewhere/."""
  data, img, elsewhere = tmp_path / "data", tmp_path / "data" / "img", tmp_path / "elsewhere"
  for d in (data, img, elsewhere):
    d.mkdir(parents=True, exist_ok=True)
  red, green = np.zeros((4, 6, 3), np.uint8), np.zeros((5, 3, 3), np.uint8)
  red[..., 0], green[..., 1] = 255, 255
  (img / "red.png").write_bytes(_encode(Image.fromarray(red), "PNG"))
  (elsewhere / "green.bmp").write_bytes(_encode(Image.fromarray(green), "BMP"))
  (img / "corrupt.png").write_bytes(_encode(Image.fromarray(red), "PNG")[:40])
  (img / "empty.png").write_bytes(b"")
  (img / "big.png").write_bytes(_encode(Image.new("L", (200, 200)), "PNG"))
  _write_jsonl(data / "b.jsonl", [
      {"image": "img/red.png", "text": "red, relative."},
      {"image": str(elsewhere / "green.bmp"), "text": "green, absolute.", "extra": 1},
      {"image": "img/corrupt.png", "text": "cut short."},
      "",
      {"image": "img/missing.png", "text": "not there."},
      {"image": "img/empty.png", "text": "no bytes."},
      {"image": "img/big.png", "text": "too big."},
  ])
  _write_jsonl(data / "a.jsonl", [{"image": "img/red.png", "text": "first file, first."}])
  (data / "notes.txt").write_text("not a listing\n")
  return tmp_path


@pytest.mark.parametrize("source", ["data/*.jsonl", "data", "file://{root}/data/*.jsonl"])
def test_read_pairs_yields_good_images_and_counts_bad_ones(pairs_dir, source, caplog):
  caplog.set_level(logging.WARNING, logger="moejax.vision")
  path = source.format(root=pairs_dir) if "{" in source else str(pairs_dir / source)
  skips = SkipLog()
  got = list(read_pairs(path, max_decode_pixels=10_000, skips=skips))
  assert [ex.text for ex in got] == ["first file, first.", "red, relative.", "green, absolute."]
  assert all(ex.kind == "pairs" and ex.label == {} for ex in got)
  assert got[1].image.shape == (4, 6, 3) and (got[1].image[..., 0] == 255).all()
  assert got[2].image.shape == (5, 3, 3) and (got[2].image[..., 1] == 255).all()
  assert skips.counts() == {"corrupt": 1, "missing": 1, "empty": 1, "oversized": 1}
  assert skips.total == 4
  warnings = [r.getMessage() for r in caplog.records if r.name == "moejax.vision"]
  assert len(warnings) == 4
  for line, reason, name in [(3, "corrupt", "corrupt.png"), (5, "missing", "missing.png"),
                             (6, "empty", "empty.png"), (7, "oversized", "big.png")]:
    [message] = [m for m in warnings if f"b.jsonl:{line} " in m]
    assert reason in message and name in message and f"(1 {reason} so far)" in message


def test_read_pairs_other_field_names(tmp_path):
  (tmp_path / "x.png").write_bytes(_encode(Image.fromarray(RNG_IMAGE), "PNG"))
  _write_jsonl(tmp_path / "p.jsonl", [{"path": "x.png", "caption": "noise."}])
  [ex] = read_pairs(str(tmp_path / "p.jsonl"), image_field="path", text_field="caption",
                    max_decode_pixels=BIG, skips=SkipLog())
  assert ex.text == "noise." and np.array_equal(ex.image, RNG_IMAGE)


@pytest.mark.parametrize(("line", "match"), [
    ("{not json", "not a JSON line"),
    ('["x.png", "text"]', "expected a JSON object"),
    ('{"text": "no image."}', "no 'image' field"),
    ('{"image": "x.png"}', "no 'text' field"),
    ('{"image": 5, "text": "a number."}', "'image' must be a string"),
    ('{"image": "x.png", "text": null}', "'text' must be a string"),
    ('{"image": "x.png", "text": ""}', "'text' is empty"),
    ('{"image": "", "text": "no path."}', "'image' is empty"),
])
def test_malformed_lines_raise_with_their_line_number(tmp_path, line, match):
  (tmp_path / "x.png").write_bytes(_encode(Image.fromarray(RNG_IMAGE), "PNG"))
  _write_jsonl(tmp_path / "bad.jsonl", [{"image": "x.png", "text": "fine."}, line])
  # The listing is read whole before any image: a malformed line fails before the first pair.
  pairs = read_pairs(str(tmp_path / "bad.jsonl"), max_decode_pixels=BIG, skips=SkipLog())
  with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{match}"):
    next(pairs)
  with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{match}"):
    list_pairs(str(tmp_path / "bad.jsonl"))


def test_read_pairs_with_no_files(tmp_path):
  with pytest.raises(ValueError, match="no such file"):
    list(read_pairs(str(tmp_path / "none.jsonl"), max_decode_pixels=BIG, skips=SkipLog()))
  with pytest.raises(ValueError, match="match no files"):
    list(read_pairs(str(tmp_path / "*.jsonl"), max_decode_pixels=BIG, skips=SkipLog()))
