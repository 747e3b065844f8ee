"""loomtrain: distributed training of LLMs, written on torch.distributed collectives."""

__version__ = "0.1.0"
