"""Past one process: tensor parallelism over torch.distributed (gloo, CPU)."""
