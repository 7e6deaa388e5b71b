"""How an algorithm's gradient step runs: eagerly, compiled (``algo.compile``), and on a GPU replayed
as one CUDA graph (``algo.cuda_graph``).

At RL's sizes a GPU learner is launch-bound: a SAC step is a few hundred kernels of microseconds
each, and Python launching them one by one is what costs. A step function here takes tensors
(or dicts of them) and returns tensors, with the backward passes, the gradient clipping, the
non-finite guard and the optimizer steps inside it. ``torch.compile`` fuses its kernels; a CUDA
graph (captured after a few warm-up steps on a side stream, as PyTorch's whole-network capture
does) replays all of them with one launch, the inputs copied into the graph's own tensors first.
Nothing in a step may read a value on the host (``.item()``) or draw random numbers: the caller
samples the noise and the minibatch, so a compiled step computes exactly what the eager one does.

Calls of another batch size than the step's (a smaller last minibatch), or whose inputs otherwise
differ from the first compiled call's, run eagerly rather than compiling or capturing again.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from typing import Annotated

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from rltrain.rules import OneOf

log = logging.getLogger("rltrain")

# algo.compile and algo.cuda_graph: on, off, or auto (on with a CUDA learner; see the functions below).
Switch = Annotated[bool | str, OneOf((True, False, "auto"), "true, false or auto (on with device=cuda)")]
WARMUP_STEPS = 3  # compiled steps run before the capture (the first compiles; allocations settle)


def compile_enabled(value: bool | str, device: torch.device) -> bool:
    """``algo.compile``; ``auto``: on for a CUDA learner where Triton (inductor's GPU code generator)
    is installed; off on the CPU, where a 15-30 s compile saves at most a third of a small
    network's step (benchmarks/RESULTS.md)."""
    if value == "auto":
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None
    return bool(value)


def cuda_graph_enabled(value: bool | str, device: torch.device) -> bool:
    """``algo.cuda_graph``; ``auto``: on for a CUDA learner."""
    return device.type == "cuda" if value == "auto" else bool(value)


def plain(obs):
    """An observation as a step takes it: a tensor, or a Dict observation's TensorDict as a plain dict."""
    return obs.to_dict() if hasattr(obs, "to_dict") else obs


class UpdateStep:
    """``step(*inputs)`` as configured. ``name`` is what the compile-time log line calls it;
    ``batch_size`` the leading size of the inputs that are compiled and captured."""

    def __init__(self, fn: Callable, name: str, compile: bool, cuda_graph: bool, batch_size: int):
        self.fn, self.name, self.batch_size = fn, name, batch_size
        self.compile, self.cuda_graph = compile, cuda_graph
        self._run: Callable | None = None  # the compiled function, once made
        self._signature: list | None = None  # the inputs' (shape, dtype, device) that are compiled/captured
        self._calls = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_in: list[torch.Tensor] = []
        self._static_out: list[torch.Tensor] = []
        self._out_spec = None

    def __call__(self, *inputs):
        if not (self.compile or self.cuda_graph):
            return self.fn(*inputs)
        flat, spec = tree_flatten(inputs)
        if flat[0].shape[0] != self.batch_size:
            return self.fn(*inputs)
        signature = [(t.shape, t.dtype, t.device) for t in flat]
        if self._signature is None:
            self._signature = signature
        elif signature != self._signature:
            return self.fn(*inputs)
        if self._graph is not None:
            torch._foreach_copy_(self._static_in, flat)
            self._graph.replay()
            return tree_unflatten([t.clone() for t in self._static_out], self._out_spec)
        if self._run is None:
            self._run = torch.compile(self.fn) if self.compile else self.fn
        if not self.cuda_graph:
            return self._timed(self._run, inputs)
        if self._calls < WARMUP_STEPS:
            return self._warm_up(inputs)
        return self._capture(flat, spec)

    def _timed(self, run: Callable, inputs: tuple):
        """``run(*inputs)``; the first call (which compiles) is timed and logged."""
        self._calls += 1
        if self._calls > 1:
            return run(*inputs)
        t0 = time.perf_counter()
        out = run(*inputs)
        if self.compile:
            log.info("algo.compile: %s compiled in %.1f s (once per run)", self.name, time.perf_counter() - t0)
        return out

    def _warm_up(self, inputs: tuple):
        """A real step, on a side stream: what a capture needs settled (compilation, cuBLAS
        workspaces, the optimizer's state, the allocator's pools) is made outside the graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self._timed(self._run, inputs)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, flat: list[torch.Tensor], spec):
        """Record the step into a CUDA graph over copies of this call's inputs, then replay it once:
        a capture records kernels without running them, and this call's step is still owed."""
        t0 = time.perf_counter()
        self._static_in = [t.clone() for t in flat]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run(*tree_unflatten(self._static_in, spec))
        self._static_out, self._out_spec = tree_flatten(out)
        self._graph = graph
        graph.replay()
        log.info("algo.cuda_graph: %s captured as a CUDA graph in %.2f s, after %d warm-up steps", self.name,
                 time.perf_counter() - t0, WARMUP_STEPS)
        return tree_unflatten([t.clone() for t in self._static_out], self._out_spec)
