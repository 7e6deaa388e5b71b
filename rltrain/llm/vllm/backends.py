"""vLLM's weight-transfer engines as ``sync=vllm_transfer`` uses them, and rltrain's gloo backend for vLLM.

The engine (rltrain's own, or a user's server) runs with ``weight_transfer_config={"backend": ...}``, and
each push drives vLLM's four calls: ``init_weight_transfer_engine`` once, then per version
``start_weight_update``, ``update_weights`` (while the learner sends) and ``finish_weight_update``.
The learner's side is vLLM's own ``TrainerWeightTransferEngine`` for the backend, built by
``WeightTransferTrainerFactory``, reading the learner's weights in vLLM's names (``WeightsSource``):

- ``nccl``: vLLM's NCCL broadcast, GPU to GPU; the engine on another GPU than the learner's (NCCL
  takes one rank per device), or on another machine.
- ``ipc``: vLLM's CUDA IPC; the engine on the learner's GPU, which reads the learner's tensors in place.
- ``gloo``: rltrain's own backend, registered into vLLM's factories as ``rltrain_gloo``: the weights
  gathered into one host buffer (one copy) and broadcast over a gloo process group on TCP, whose
  store the learner hosts. For CPU engines elsewhere than the learner's machine (a server in another
  container or host, which cannot map ``sync=vllm``'s slots), and the way this path runs where
  there is no GPU. The engine loads with ``VLLMModel`` (names checked, embedding repacked).

This module imports vLLM: only processes that push through vLLM's API (or serve with the gloo backend) import it.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import distributed as dist
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from rltrain.llm.vllm import BACKENDS
from rltrain.llm.vllm.aside import Aside
from rltrain.process_groups import StoreAddress, gloo_group, seconds
from rltrain.sync.base import FlatBuffer

GLOO = BACKENDS["gloo"]
_groups = itertools.count()


def register() -> None:
    """rltrain's gloo backend into vLLM's two factories (once per process)."""
    if GLOO not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO, GlooWeightTransferEngine)
    if GLOO not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(GLOO, GlooTrainerWeightTransferEngine)


class WeightsSource(WeightSource):
    """The learner's weights as vLLM's trainer engines read them: ``weights()`` (the served weights, in
    vLLM's names, LoRA merged) at each pass."""

    def __init__(self, weights: Callable[[], dict[str, torch.Tensor]]):
        self._weights, self._declared = weights, None

    def metadata(self) -> list[ParamMeta]:
        self._declared = self._weights()  # the pass that follows sends these (LoRA merged once per push)
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._declared.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        weights, self._declared = self._declared or self._weights(), None
        yield from weights.items()


def trainer_engine(backend: str, client, source: WeightsSource, address: str,
                   timeout_s: float) -> TrainerWeightTransferEngine:
    """vLLM's learner side of ``backend``, joined with the engine behind ``client`` (the four calls);
    ``address``: where the engine reaches this process (its store or NCCL rendezvous)."""
    if backend == "gloo":
        info = GlooTrainerInitInfo(rank=0, master_address=address, timeout_s=timeout_s)
    elif backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(rank=0, master_address=address, master_port=free_port(address), world_size=2)
    elif backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=0)
    else:
        raise ValueError(f"sync.backend={backend!r}: one of {', '.join(BACKENDS)} goes through vLLM's API")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def address_toward(host: str) -> str:
    """This machine's address on the route to ``host`` (127.0.0.1 for a loopback one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: the kernel only picks the route
        return s.getsockname()[0]


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """The engine's side of a ``gloo`` transfer: where the learner's store is, and this group's keys in it."""

    master_address: str
    master_port: int
    prefix: str
    timeout_s: float = 60.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One push: every weight's name, dtype and shape, in the order of the broadcast buffer."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def _layout(names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> dict:
    return {name: (tuple(shape), getattr(torch, dtype)) for name, dtype, shape in zip(names, dtype_names, shapes)}


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The engine's side (in vLLM's worker): receives each push into one host buffer, then loads it with
    ``VLLMModel`` (vLLM's layerwise reload, the learner's names checked against the model's)."""

    init_info_cls, update_info_cls = GlooInitInfo, GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._group = None
        self._buffer: FlatBuffer | None = None
        self._loader = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        address = StoreAddress(init_info.master_address, init_info.master_port, init_info.prefix)
        store = address.connect(init_info.timeout_s)
        self._timeout_s = init_info.timeout_s
        self._group = gloo_group(store, "weights", 1, 2, init_info.timeout_s,
                                 loopback=init_info.master_address.startswith("127."))

    def start_weight_update(self) -> None:
        """Nothing: ``VLLMModel.load`` runs the layerwise reload around its load."""

    def finish_weight_update(self) -> None:
        """Nothing (see ``start_weight_update``)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # vLLM's base synchronizes always, which fails without an accelerator
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from rltrain.llm.vllm.loading import VLLMModel

        if self._group is None:
            raise RuntimeError("a gloo weight update before init_weight_transfer_engine")
        layout = _layout(update_info.names, update_info.dtype_names, update_info.shapes)
        if self._buffer is None or self._buffer.layout != layout:
            self._buffer = FlatBuffer(layout, shared=False)
        self._group.broadcast(self._buffer.buffer, 0, seconds(self._timeout_s)).wait()
        if self._loader is None or self._loader.model is not self.model:
            self._loader = VLLMModel(self.model, self.model_config)
        self._loader.load(self._buffer.views)

    def shutdown(self) -> None:
        self._group, self._buffer = None, None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The learner's side of a ``gloo`` transfer: the address it hosts its store on (one the engine reaches)."""

    backend: ClassVar[str] = GLOO
    master_address: str = "127.0.0.1"
    timeout_s: float = 60.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The learner's side: hosts a store, joins the engine in a two-process gloo group, and at each push
    copies the weights into one host buffer and broadcasts it while the engine receives."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("the gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source)
        engine._timeout_s = init_info.timeout_s
        engine._store = dist.TCPStore(init_info.master_address, 0, None, True, timeout=seconds(init_info.timeout_s),
                                      wait_for_workers=False)
        prefix = f"rltrain/weights-{os.getpid()}-{next(_groups)}/"
        worker = GlooInitInfo(init_info.master_address, engine._store.port, prefix, init_info.timeout_s)
        joined = Aside(client.init_weight_transfer_engine, asdict(worker))
        engine._group = gloo_group(dist.PrefixStore(prefix, engine._store), "weights", 0, 2, init_info.timeout_s,
                                   loopback=init_info.master_address.startswith("127."), watch=joined.raise_if_failed)
        joined.result(init_info.timeout_s)
        engine._buffer = None
        return engine

    def send_weights(self) -> None:
        weights = dict(iter(self.source))
        layout = {name: (tuple(t.shape), t.dtype) for name, t in weights.items()}
        if self._buffer is None or self._buffer.layout != layout:
            self._buffer = FlatBuffer(layout, shared=False, pinned=any(t.is_cuda for t in weights.values()))
        self._buffer.copy_from(weights)
        names = list(layout)
        info = GlooUpdateInfo(names, [str(layout[n][1]).removeprefix("torch.") for n in names],
                              [list(layout[n][0]) for n in names])
        self.client.start_weight_update()
        received = Aside(self.client.update_weights, asdict(info))
        sent = self._group.broadcast(self._buffer.buffer, 0, seconds(self._timeout_s))
        deadline = time.monotonic() + self._timeout_s
        while not sent.is_completed():  # an engine that failed before receiving is reported, not waited for
            received.raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not receive the weights within {self._timeout_s:g}s")
            time.sleep(0.002)
        sent.wait()
        received.result(self._timeout_s)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self._group = self._store = None


register()
