"""How the learner runs: in one process (``strategy=single``, ``Single``) or data-parallel on every
rank of a torchrun job (``strategy=ddp``, ``DDP``: torch's ``DistributedDataParallel``)."""

from rltrain.strategies.base import Single, Strategy
from rltrain.strategies.ddp import DDP

__all__ = ["DDP", "Single", "Strategy"]
