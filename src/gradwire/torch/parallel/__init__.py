"""BytePS's `byteps.torch.parallel`: a module wrapper in the shape of torch's DistributedDataParallel."""

from .distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
