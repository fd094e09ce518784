"""Native-resolution image input: a MoonViT-style encoder whose tokens take the place of image
placeholders in the decoder's text stream (docs/vision.md)."""
