"""moejax: hybrid KDA/MLA Mixture-of-Experts language models in JAX/Flax."""
