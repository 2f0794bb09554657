"""CheckpointService: models, the checkpoint tree and compare-and-swap head pointers."""
