"""Weight-sync schemes: how the learner's policy weights reach the collectors."""

from rltrain.sync.base import WeightReceiver, WeightSender, WeightSyncScheme
from rltrain.sync.distributed import DistributedReceiver, DistributedSync, listen
from rltrain.sync.in_place import InPlaceSync
from rltrain.sync.none import NoSync
from rltrain.sync.pipe import PipeSync
from rltrain.sync.shared_mem import SharedMemSync

__all__ = ["DistributedReceiver", "DistributedSync", "InPlaceSync", "NoSync", "PipeSync", "SharedMemSync",
           "WeightReceiver", "WeightSender", "WeightSyncScheme", "listen"]
