"""Local training on a client: device selection, the training loop, the node runtime."""
