"""The parts of a sharded learner's checkpoint (``strategy=fsdp``) that every rank writes its own shards of,
with torch.distributed.checkpoint (DCP): the modules an algorithm trains, and their optimizers.

Each part is saved and loaded as torch's own state dicts give it (``get_model_state_dict``,
``get_optimizer_state_dict``: keyed by parameter name; DTensor shards under fsdp, whole tensors in one
process). DCP reshards as it loads, so what 2 ranks wrote resumes on 1 process, on 2 or on 4, each reading
only what it holds. ``rltrain.checkpoint`` places these files in the checkpoint's directory beside the rest of
the state, which rank 0 writes.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from rltrain.algos.optimizers import load_adam
from rltrain.errors import CheckpointError

WEIGHTS, OPTIMIZER = "weights", "optimizer"


class Part(Stateful):
    """A module and the optimizer over its trained parameters (None: a frozen module) as DCP saves and loads
    them. Loading keeps this run's optimizer options (fused, its lr tensor), as a one-file checkpoint does."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict:
        state = {WEIGHTS: get_model_state_dict(self.module)}
        if self.optimizer is not None:  # (a fresh optimizer's state is made first, for loading into)
            state[OPTIMIZER] = get_optimizer_state_dict(self.module, self.optimizer)
        return state

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.module, state[WEIGHTS])
        if self.optimizer is not None:
            load_adam(self.optimizer, state[OPTIMIZER],
                      load=lambda saved: set_optimizer_state_dict(self.module, self.optimizer, saved))


def parts_of(trained: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]]) -> dict[str, Part]:
    return {name: Part(module, optimizer) for name, (module, optimizer) in trained.items()}


def write(folder: Path, parts: dict[str, Part]) -> None:
    """This rank's shards of ``parts`` into ``folder`` (every rank of the learner calls it, together)."""
    dcp.save(parts, storage_writer=dcp.FileSystemWriter(folder, sync_files=True))


def read(folder: Path, parts: dict[str, Part], sharded: bool) -> None:
    """Load ``parts`` from ``folder`` in place, after checking that the saved weights fit them; ``sharded``:
    every rank of a sharded learner calls it together (else this process reads alone, whole tensors)."""
    try:
        saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001  (no .metadata: not written to its end, or not a DCP folder)
        raise CheckpointError(f"{folder} holds no complete sharded checkpoint ({type(e).__name__}: {e})") from None
    problems = []
    for name, part in parts.items():
        for key, tensor in get_model_state_dict(part.module).items():
            where = f"{name}.{WEIGHTS}.{key}"
            if where not in saved:
                problems.append(f"{where} is not in the checkpoint")
            elif tuple(size := getattr(saved[where], "size", ())) != tuple(tensor.shape):
                problems.append(f"{where} has shape {list(size)} there and {list(tensor.shape)} here")
    if problems:
        raise CheckpointError(f"{folder} does not fit this run's model: {'; '.join(problems[:3])}"
                              f"{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}; resume with the "
                              "model that wrote it, or start a new run")
    with warnings.catch_warnings():  # (one process: torch warns that it assumes one process)
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(parts, checkpoint_id=folder, no_dist=not sharded)
