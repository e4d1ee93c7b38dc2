"""Running one model over several processes: tensor parallel (heads and MLP split, one all-reduce per half-layer)
and pipeline parallel (layer ranges), on torch.distributed (gloo on CPU, NCCL on CUDA)."""
