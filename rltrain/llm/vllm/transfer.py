"""``sync=vllm_transfer``: the learner's weights into a vLLM engine through vLLM's weight-transfer API.

Each push drives vLLM's four calls (``init_weight_transfer_engine`` once, then per version
``start_weight_update``, ``update_weights`` while the learner sends, ``finish_weight_update``) through
the engine's ``transfer_client()``, which build connects the sender to once the engine runs. The engine
takes the new version after the batch it is generating, if any, and before the next one (a server is
paused around it). Nothing is staged: the learner's weights do not change during a push. ``backend``:

- ``gloo``: rltrain's own backend (``rltrain.llm.vllm.backends``): one host buffer broadcast over a gloo
  group on TCP. For a CPU engine elsewhere than the learner's machine, and where there is no GPU.
- ``nccl``: vLLM's NCCL broadcast, GPU to GPU; the engine on another GPU than the learner's, or machine.
- ``ipc``: vLLM's CUDA IPC; the engine on the learner's GPU, reading the learner's tensors in place.

The engine's receiver is a ``TransferReceiver``: vLLM's own backend does the receiving, so it only
names the backend the engine starts vLLM with, and holds the version the engine reports.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Callable
from typing import Annotated, Protocol

import torch
from torch import nn

from rltrain.device import resolve_device
from rltrain.errors import CollectorError, ConfigError, SyncError
from rltrain.llm.vllm import BACKENDS
from rltrain.llm.vllm.aside import Aside
from rltrain.llm.vllm.loading import checkpoint_names, names_unlike, served_weights
from rltrain.rules import OneOf, PositiveNumber
from rltrain.sync.base import WeightReceiver, WeightSender, WeightSyncScheme


class TransferClient(Protocol):
    """An engine's side of a push, as the sender drives it: vLLM's four calls (``VLLMWeightSyncClient``'s),
    plus what the sender needs around them."""

    source: str  # the served model (a model dir: its weight names are checked against the learner's)
    version: int  # what the next ``finish_weight_update`` stamps the engine's weights with

    def init_weight_transfer_engine(self, init_info: dict) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def finish_batch(self) -> None:
        """Wait for the batch being generated, if any: a push comes after it (no batch mixes two versions)."""

    def check_alive(self) -> None:
        """Raise CollectorError if the engine is gone."""

    def address(self) -> str:
        """This machine's address as the engine reaches it (the transfer's store or rendezvous)."""

    def abort(self) -> None:
        """Undo what a failed push left half done on the engine's side."""


class TransferSender(WeightSender):
    """Pushes through vLLM's weight-transfer API once build has connected it to the engine (``connect``):
    each ``push`` sends the learner's served weights as the new version, bounded by ``timeout_s`` and
    watching the engine."""

    def __init__(self, policy: nn.Module, backend: str, timeout_s: float, version: int):
        self._policy, self.backend, self.timeout_s, self.version = policy, backend, timeout_s, version
        self.delivered = -1  # the last version the engine holds
        self._client = self._engine = None

    def connect(self, client: TransferClient) -> None:
        """Join the engine behind ``client`` (its ``transfer_client()``) and push the current weights: the
        layout check, and a resumed run's weights."""
        from rltrain.llm.vllm.backends import WeightsSource, trainer_engine

        source = client.source
        if unlike := names_unlike(checkpoint_names(source), set(served_weights(self._policy))):
            raise SyncError(f"sync=vllm_transfer: the learner's weights are not the served model's ({source}): "
                            f"{unlike}")
        self._client = client
        weights = WeightsSource(lambda: served_weights(self._policy))
        self._engine = self._bounded("joining the engine for weight transfer",
                                     lambda: trainer_engine(self.backend, client, weights, client.address(),
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
                raise SyncError(f"sync=vllm_transfer ({self.backend}): {doing} did not end within {self.timeout_s:g}s "
                                "(sync.timeout_s); the engine is alive but the transfer is stuck")
        try:
            return aside.result(0)
        except (CollectorError, SyncError):
            raise
        except Exception as e:
            self._client.check_alive()  # an engine that died mid-push is the fault to name
            raise SyncError(f"sync=vllm_transfer ({self.backend}): {doing} failed: {type(e).__name__}: {e}") from e

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


class TransferReceiver(WeightReceiver):
    """The engine's side of ``sync=vllm_transfer``: vLLM's own backend receives (rltrain's engine starts vLLM
    with ``backend``); ``version`` is what the engine last finished loading."""

    def __init__(self, backend: str):
        self.backend = backend

    def connect(self, model) -> None:
        """Nothing: vLLM's transfer backend loads into the model."""

    def poll(self) -> bool:
        """Nothing: a push is the learner's own call, which ends before the engine's next batch starts."""
        return False


class VLLMTransferSync(WeightSyncScheme):
    """Pushes through vLLM's weight-transfer API with ``backend`` (gloo, nccl, ipc), after every update."""

    DELIVERS = "push"
    # (FSDP's gathers beside another group's sends are the interleaving that hangs TRL's sharded pushes.)
    NOT_ON_LEARNER_RANKS = ("each rank would push through vLLM's transfer group beside the learner's own "
                            "collectives, untried; use sync=vllm, whose engine of each rank loads that rank's "
                            "pushes itself")
    MOVED_KEYS = {"transport": "is now sync.backend (gloo, nccl or ipc)",
                  "every": "is no key of sync=vllm_transfer: the engine gets the weights of every update"}

    def __init__(self, backend: Annotated[str, OneOf(tuple(BACKENDS))] = "gloo", timeout_s: PositiveNumber = 30.0):
        super().__init__(1)
        self.backend, self.timeout_s = backend, timeout_s

    @classmethod
    def check_config(cls, values: dict, config: dict) -> None:
        backend = values.get("backend", "gloo")
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("sync=vllm_transfer drives vLLM's weight-transfer API from the learner, and vLLM is not "
                              "installed here: pip install 'rltrain[vllm]' (on a GPU machine: pip install vllm), or "
                              "sync=vllm (shared-memory slots)")
        device = resolve_device(config.get("device", "auto"))
        if backend in ("nccl", "ipc") and device.type != "cuda":
            raise ConfigError(f"sync.backend={backend} moves GPU tensors, and the learner is on {device}: use "
                              "device=cuda, or sync.backend=gloo (or sync=vllm) on the CPU")

    def sender(self, policy: nn.Module, version: int = 0) -> TransferSender:
        return TransferSender(policy, self.backend, self.timeout_s, version)

    def receiver(self) -> TransferReceiver:
        return TransferReceiver(BACKENDS[self.backend])
