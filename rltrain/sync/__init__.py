"""Weight-sync schemes: how the learner's policy weights reach the collectors."""

from rltrain.sync.base import WeightReceiver, WeightSender, WeightSyncScheme
from rltrain.sync.distributed import DistributedReceiver, DistributedSync, listen
from rltrain.sync.none import NoSync
from rltrain.sync.pipe import PipeSync
from rltrain.sync.shared_mem import SharedMemSync
from rltrain.sync.vllm import VLLMSync

__all__ = ["DistributedReceiver", "DistributedSync", "NoSync", "PipeSync", "SharedMemSync", "VLLMSync",
           "WeightReceiver", "WeightSender", "WeightSyncScheme", "listen"]
