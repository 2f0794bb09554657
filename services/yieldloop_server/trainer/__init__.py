"""TrainerService: weights in training, the optimizer and the losses."""
