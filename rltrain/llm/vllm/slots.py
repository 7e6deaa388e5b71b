"""``sync=vllm``: the learner's weights into a vLLM engine as snapshots the engine loads itself.

The learner's side is ``sync=shared_mem``'s: each push copies the weights into a free shared-memory
slot and publishes its version and index together, one copy whatever the model's size, no call per
tensor. What is published is what vLLM loads: the parameters by their Hugging Face names; for a model
with LoRA adapters, the adapters alone (``sync.adapters=true``, the default: rltrain's engine applies
each version as a vLLM adapter of its own, ``adapter_weights``), or the merged weights (``false``:
``served_weights``; what a server of the user's own loads).

The receiver is a ``SnapshotReceiver``, which the engine binds to its model (``connect(target)``: anything
with ``load_slot(slot, version)``, raising ValueError for weights that do not fit): in rltrain's engine
process, ``rltrain.llm.vllm.loading.VLLMModel`` (vLLM's own in-place reload, before each request it
serves); for a user's server, ``rltrain.llm.vllm.server.ServerModel`` in the learner's process (the
server loads the slot, paused). A slot is held pinned while it is read, so no completion is generated
with a mix of two versions; the first load is also the check of names and shapes. Slots reach rltrain's
engine as file descriptors when it is spawned: nothing is left in /dev/shm whatever way either process ends.

A push after every update: ``sync.every`` is no key of this scheme, since a resumed run could not give
the engine back weights it held between pushes (what is published is vLLM's names, not the policy's).
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import nn

from rltrain.errors import SyncError
from rltrain.llm.vllm.loading import adapter_weights, holds_adapters, served_weights
from rltrain.rules import Flag, PositiveNumber
from rltrain.sync.shared_mem import SLOTS, SharedMemSync, _SharedMemReceiver, _SharedMemSender


class _SlotsSender(_SharedMemSender):
    def published(self) -> None:
        """None: what is published is in vLLM's names (LoRA merged), not the policy's, so checkpoints keep
        no copy of it; a resumed run publishes the learner's weights, which is what the engine held, since
        every update is pushed."""
        return None


class SnapshotReceiver(_SharedMemReceiver):
    """An engine's side of ``sync=vllm``: loads each new version into the engine's model (``connect``'s
    target). ``reserve``, in the learner as it asks the engine for a generation, pins the version that
    generation uses; ``poll(reserved)``, where the engine runs, loads it."""

    @property
    def adapters(self) -> bool:
        """Whether what is published is a LoRA learner's adapters alone (the engine then serves them on the
        base model), not whole weights."""
        return holds_adapters(self._shared.slots[0].views)

    def connect(self, target) -> None:
        """Bind to the engine's model (``load_slot(slot, version)``) and load the newest version into it."""
        self._policy = target
        self.poll()

    def reserve(self) -> int:
        """Pin the newest published version for the engine's next load, from the process that asks for
        a generation (the learner's): a push that lands before the engine reads the request does not
        change which version generates it, so the lag is the same on a busy machine. Its word, for
        ``poll``."""
        return self._pin_newest()

    def poll(self, reserved: int | None = None) -> bool:
        """Load the version ``reserve`` pinned (``reserved``, its word), else the newest; unpinned after."""
        shared, n_slots = self._shared, len(self._shared.slots)
        if reserved is None:
            if int(shared.word) // n_slots == self.version:
                return False
            reserved = self._pin_newest()
        version = reserved // n_slots
        try:
            if version == self.version:
                return False
            try:
                self._policy.load_slot(shared.slots[reserved % n_slots], version)
            except ValueError as e:
                raise SyncError(f"sync=vllm: weights version {version} do not fit the engine's model: {e}") from None
        finally:
            self._pin.fill_(-1)  # loaded (copied into vLLM's own tensors): the slot is free again
        self.version = version
        return True


class VLLMSlotsSync(SharedMemSync):
    """``sync=shared_mem``'s versioned slots, loaded by a vLLM engine before each of its generations."""

    DELIVERS = "snapshot"
    MOVED_KEYS = {"transport": "is now the scheme itself: sync=vllm (these slots) or sync=vllm_transfer "
                               "sync.backend=gloo|nccl|ipc (vLLM's weight-transfer API)",
                  "every": "is no key of sync=vllm: the engine gets the weights of every update (a resumed run "
                           "could not give it back weights it held between pushes)"}
    _sender_class, _receiver_class = _SlotsSender, SnapshotReceiver

    def __init__(self, slots: Annotated[int, SLOTS] = 3, timeout_s: PositiveNumber = 30.0,
                 adapters: Flag = True):  # a LoRA learner's pushes: its adapters alone (false: merged weights)
        super().__init__(1, slots, timeout_s)
        self.adapters = adapters

    def weights_of(self, policy: nn.Module) -> dict[str, torch.Tensor]:
        if self.adapters and hasattr(policy, "get_base_model"):
            return adapter_weights(policy)
        return served_weights(policy)
