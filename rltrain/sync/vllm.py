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

``transport`` other than ``shared_mem`` (``gloo``, ``nccl``, ``ipc``): each push goes through vLLM's
weight-transfer API instead (``rltrain.llm.vllm_transfer``), driven by the learner as it pushes: the
engine takes the new version after the batch it is generating, if any, and before the next one (a
server is paused around it). Nothing is staged: the learner's weights do not change during a push.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Annotated

import torch
from torch import nn

from rltrain.errors import CollectorError, SyncError
from rltrain.rules import OneOf, PositiveNumber
from rltrain.sync.base import WeightReceiver, WeightSender
from rltrain.sync.shared_mem import SLOTS, SharedMemSync, _SharedMemReceiver, _SharedMemSender

BACKENDS = {"gloo": "rltrain_gloo", "nccl": "nccl", "ipc": "ipc"}  # sync.transport -> vLLM's weight-transfer backend
TRANSPORTS = ("shared_mem", *BACKENDS)  # sync.transport


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

    def engine_options(self) -> dict:
        """What the engine's ``LLM`` takes for this receiver's pushes."""
        return {}

    def prepare(self) -> None:
        """In the engine's process, before vLLM starts."""

    def attach(self, client, source: str) -> None:
        """In the learner, once the engine runs: nothing, its loads are its own (see ``poll``)."""

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


class Aside:
    """A call running on a daemon thread of its own: one that may never return (a wait in a collective
    whose peer died) must not hold up the process's exit."""

    def __init__(self, call: Callable, *args):
        self._outcome: list = []
        self._thread = threading.Thread(target=self._run, args=(call, *args), name="rltrain-vllm-call", daemon=True)
        self._thread.start()

    def _run(self, call, *args):
        try:
            self._outcome.append((True, call(*args)))
        except BaseException as e:  # noqa: BLE001  (raised in the caller's thread)
            self._outcome.append((False, e))

    def done(self, wait_s: float = 0.0) -> bool:
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def raise_if_failed(self) -> None:
        if self._outcome and not self._outcome[0][0]:
            raise self._outcome[0][1]

    def result(self, timeout_s: float):
        if not self.done(timeout_s):
            raise TimeoutError(f"no answer within {timeout_s:g}s")
        ok, value = self._outcome[0]
        if not ok:
            raise value
        return value


class _TransferSender(WeightSender):
    """Pushes through vLLM's weight-transfer API, once the engine is up (``attach``): each ``push`` sends
    the learner's served weights as the new version, bounded by ``timeout_s`` and watching the engine."""

    def __init__(self, policy: nn.Module, transport: str, timeout_s: float, version: int):
        self._policy, self.transport, self.timeout_s, self.version = policy, transport, timeout_s, version
        self.delivered = -1  # the last version the engine holds
        self._client = self._engine = None

    def attach(self, client, source: str) -> None:
        """Join the engine behind ``client`` (vLLM's four calls, ``check_alive``, ``abort``, ``address``) and
        push the current weights: the layout check, and a resumed run's weights."""
        from rltrain.llm.vllm_engine import checkpoint_names, names_unlike
        from rltrain.llm.vllm_transfer import WeightsSource, trainer_engine

        if unlike := names_unlike(checkpoint_names(source), set(served_weights(self._policy))):
            raise SyncError(f"sync=vllm: the learner's weights are not the served model's ({source}): {unlike}")
        self._client = client
        source = WeightsSource(lambda: served_weights(self._policy))
        self._engine = self._bounded("joining the engine for weight transfer",
                                     lambda: trainer_engine(self.transport, client, source, client.address(),
                                                            self.timeout_s))
        self._send()

    def push(self) -> int:
        self.version += 1
        if self._engine is not None:
            self._send()
        return self.version

    def _send(self) -> None:
        self._client.finish_batch()  # the batch being generated ends with the weights it started with
        self._client.version = self.version
        try:
            self._bounded(f"pushing weights version {self.version}", self._engine.send_weights)
        except BaseException:
            self._client.abort()
            raise
        self.delivered = self.version

    def _bounded(self, doing: str, call: Callable):
        """``call()`` on a thread of its own (a transfer stuck in a collective may never return), waited for
        up to ``timeout_s`` while the engine is watched: a dead engine is named, not waited for."""
        device = next(iter(served_weights(self._policy).values())).device
        if device.type == "cuda":  # a thread's current CUDA device is 0 whatever the learner's: vLLM reads it
            call = functools.partial(_on_device, device, call)
        aside = Aside(call)
        deadline = time.monotonic() + self.timeout_s
        while not aside.done(0.2):
            self._client.check_alive()
            if time.monotonic() > deadline:
                raise SyncError(f"sync=vllm ({self.transport}): {doing} did not end within {self.timeout_s:g}s "
                                "(sync.timeout_s); the engine is alive but the transfer is stuck")
        try:
            return aside.result(0)
        except (CollectorError, SyncError):
            raise
        except Exception as e:
            self._client.check_alive()  # an engine that died mid-push is the fault to name
            raise SyncError(f"sync=vllm ({self.transport}): {doing} failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def _on_device(device: torch.device, call: Callable):
    with torch.cuda.device(device):
        # vLLM's NCCL producer packs on streams of its own, which do not wait for this one's kernels
        # (an optimizer step, a LoRA merge)
        torch.cuda.current_stream().synchronize()
        return call()


class _TransferReceiver(WeightReceiver):
    """The engine's side of a push through vLLM's API: vLLM's own (the backend its ``LLM`` is started with);
    in the learner, ``attach`` hands the engine's client to the sender. ``version``: the engine's, set as
    each push finishes."""

    def __init__(self, transport: str, sender: _TransferSender):
        self.transport, self._sender, self._version = transport, sender, -1

    @property
    def version(self) -> int:
        """The version the engine holds: in the learner, the sender's last delivered push."""
        return self._sender.delivered if self._sender is not None else self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = value

    def __getstate__(self):
        return {"transport": self.transport, "_version": self._version, "_sender": None}

    def engine_options(self) -> dict:
        return {"weight_transfer_config": {"backend": BACKENDS[self.transport]}}

    def prepare(self) -> None:
        import rltrain.llm.vllm_transfer  # noqa: F401  (registers the gloo backend into vLLM's factories)

    def attach(self, client, source: str) -> None:
        self._sender.attach(client, source)

    def reserve(self) -> None:
        """Nothing to pin: a push is the learner's own call, and ends before the next batch starts."""

    def connect(self, model) -> None:
        """Nothing: vLLM's transfer backend loads into the model."""

    def poll(self, reserved=None) -> bool:
        return False


class VLLMSync(SharedMemSync):
    """``sync=shared_mem``'s versioned slots, loaded by a vLLM engine before each of its generations; or,
    with another ``transport``, pushes through vLLM's weight-transfer API."""

    _sender_class, _receiver_class = _VLLMSender, _VLLMReceiver

    def __init__(self, every: int | None = 1, slots: Annotated[int, SLOTS] = 3, timeout_s: PositiveNumber = 30.0,
                 transport: Annotated[str, OneOf(TRANSPORTS)] = "shared_mem"):
        super().__init__(every, slots, timeout_s)
        self.transport = transport
        self._transfer: _TransferSender | None = None

    @staticmethod
    def weights_of(policy: nn.Module) -> dict[str, torch.Tensor]:
        return served_weights(policy)

    def sender(self, policy: nn.Module, version: int = 0) -> WeightSender:
        if self.transport == "shared_mem":
            return super().sender(policy, version)
        self._transfer = _TransferSender(policy, self.transport, self.timeout_s, version)
        return self._transfer

    def receiver(self) -> WeightReceiver:
        if self.transport == "shared_mem":
            return super().receiver()
        if self._transfer is None:
            raise SyncError("VLLMSync.receiver() called before sender(): the learner's side pushes")
        return _TransferReceiver(self.transport, self._transfer)
