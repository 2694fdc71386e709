"""Weight transports between the trainer and rollout engines on NVIDIA GPUs."""
