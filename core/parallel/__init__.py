"""Tensor parallelism over torch.distributed: the model's layers split over ranks (tp.py), each
weight's slice of a checkpoint (slices.py), and the ranks' lock-step loop behind `zoo serve` /
`zoo run` (distributed.py)."""
