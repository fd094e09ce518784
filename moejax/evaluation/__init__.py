"""Evaluating a trained model beyond the training loop's validation loss (docs/evaluation.md): loss by
position (perplexity), passkey retrieval and multi-query associative recall, at any length, through the
prefill path. `python -m moejax.evaluate` runs them on a workdir."""
