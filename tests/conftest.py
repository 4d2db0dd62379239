"""Tiny models run fastest on one thread: more threads only spin against each other on small CPU machines."""

import torch

torch.set_num_threads(1)
