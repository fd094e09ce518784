"""Training: the train state, the jitted step and its gradient accumulation, optimizers (AdamW,
Muon), the loss, the loop, monitoring and checkpoints."""
