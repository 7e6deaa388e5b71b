"""How the learner runs: in one process (``strategy=single``, ``Single``), data-parallel on every rank of a
torchrun job (``strategy=ddp``, ``DDP``: torch's ``DistributedDataParallel``), or data-parallel with its
weights sharded over the ranks (``strategy=fsdp``, ``FSDP``: torch's FSDP2, ``fully_shard``)."""

from rltrain.strategies.base import Single, Strategy
from rltrain.strategies.ddp import DDP
from rltrain.strategies.fsdp import FSDP

__all__ = ["DDP", "FSDP", "Single", "Strategy"]
