"""``sync=vllm``: the learner's weights into a vLLM engine (``collector.engine=vllm``).

The learner's side is ``sync=shared_mem``'s: each push copies the weights into a free shared-memory
slot and publishes its version and index together, one copy whatever the model's size, no call per
tensor. What is published is what vLLM loads: the parameters by their Hugging Face names, and for a
model with LoRA adapters the merged weights (``served_weights``).

The receiver lives in the engine's process. Before each request the engine serves, it loads the
newest published slot into vLLM's model (vLLM's own in-place reload, which fuses and repacks as it
loads a checkpoint), holding the slot pinned while it reads, so that no completion is generated
with a mix of two versions. The first load is also the check: a learner whose weights have names
or shapes vLLM's model does not take is refused then, naming them. Slots reach the engine as file
descriptors when it is spawned: nothing is left in /dev/shm whatever way either process ends.

With a vLLM server the user runs (``collector.vllm_url``) the receiver is in the learner's process
instead, and has the server load each slot (``rltrain.llm.vllm_server.ServerModel``), paused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rltrain.errors import SyncError
from rltrain.sync.shared_mem import SharedMemSync, _SharedMemReceiver, _SharedMemSender


@torch.no_grad()
def served_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an inference engine loads of a transformers ``model``: its parameters by their Hugging Face
    names; for a peft model (LoRA), its base weights with the adapters merged in (computed at each
    call: ``model`` stays as it is), never the base weights alone."""
    if not hasattr(model, "get_base_model"):
        return {name: p.detach() for name, p in model.named_parameters()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    weights = {name.replace(".base_layer.", "."): p.detach() for name, p in base.named_parameters()
               if ".lora_" not in name}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            deltas = [module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A]
            if deltas:
                weights[f"{name}.weight"] = weights[f"{name}.weight"] + sum(deltas)
    return weights


class _VLLMSender(_SharedMemSender):
    def published(self) -> None:
        """None: what is published is in vLLM's names (LoRA merged), not the policy's, so checkpoints keep
        no copy of it; a resumed run publishes the learner's weights, the same with ``sync.every=1``
        (the only value sync=vllm takes for now)."""
        return None


class _VLLMReceiver(_SharedMemReceiver):
    """Loads each new version into the engine's model: ``rltrain.llm.vllm_engine.VLLMModel`` in the
    engine's process, or a user's server's through ``rltrain.llm.vllm_server.ServerModel`` (anything
    with ``load_slot(slot)``, raising ValueError for weights that do not fit)."""

    on_load: Callable[[int], None] | None = None  # told each version before it loads (the engine reports it)

    def connect(self, model) -> None:
        self._policy = model
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
            if self.on_load is not None:
                self.on_load(version)
            try:
                self._policy.load_slot(shared.slots[reserved % n_slots])
            except ValueError as e:
                raise SyncError(f"sync=vllm: weights version {version} do not fit the engine's model: {e}") from None
        finally:
            self._pin.fill_(-1)  # loaded (copied into vLLM's own tensors): the slot is free again
        self.version = version
        return True


class VLLMSync(SharedMemSync):
    """``sync=shared_mem``'s versioned slots, loaded by a vLLM engine before each of its generations."""

    _sender_class, _receiver_class = _VLLMSender, _VLLMReceiver

    @staticmethod
    def weights_of(policy: nn.Module) -> dict[str, torch.Tensor]:
        return served_weights(policy)
