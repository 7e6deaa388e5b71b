"""The learners' Adam optimizers: made one way, so that every update step runs eagerly, compiled, or
replayed as a CUDA graph alike, and loaded back from a checkpoint of any of those runs.

- ``fused``: one kernel per step for all parameters (CPU and CUDA), and the ``found_inf`` flag
  that ``NonFiniteGuard`` sets to skip a step (~12% faster updates than foreach here).
- ``capturable`` where the step is captured in a CUDA graph: the step count lives on the GPU.
- ``lr`` as a tensor where it changes during the run (PPO's annealing): a compiled step would
  recompile for every new float, and a CUDA graph would keep the one it was captured with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# What belongs to this run rather than to the checkpoint it resumes from (Adam's load_state_dict
# takes every option from the saved param groups).
RUN_OPTIONS = ("fused", "capturable", "foreach", "differentiable")


def adam(params: Iterable[torch.nn.Parameter], lr: float, device: torch.device, graphed: bool,
         lr_tensor: bool = False, eps: float = 1e-8) -> torch.optim.Adam:
    """Fused Adam over ``params`` (on ``device``); ``graphed``: its step is captured in a CUDA graph."""
    if lr_tensor:
        lr = torch.tensor(float(lr), device=device)
    return torch.optim.Adam(params, lr=lr, eps=eps, fused=True, capturable=graphed and device.type == "cuda")


def load_adam(optimizer: torch.optim.Adam, state: dict, load: Callable[[dict], None] | None = None) -> None:
    """``optimizer.load_state_dict(state)`` (or ``load(state)``: another format's loader), keeping this run's
    options and lr tensor: a checkpoint of an eager CPU run resumes into a CUDA-graph run and back."""
    groups = optimizer.param_groups
    kept = [{k: g[k] for k in (*RUN_OPTIONS, "lr") if k in g} for g in groups]
    (load or optimizer.load_state_dict)(state)
    for group, own in zip(optimizer.param_groups, kept):
        saved_lr = group["lr"]
        group.update(own)
        if own.get("fused") or own.get("capturable"):  # a state saved unfused keeps its step on the CPU
            for p in group["params"]:
                if "step" in optimizer.state.get(p, {}):
                    optimizer.state[p]["step"] = optimizer.state[p]["step"].to(p.device, torch.float32)
        if isinstance(own.get("lr"), torch.Tensor):  # the same tensor a compiled step or graph reads
            group["lr"].fill_(float(saved_lr))
        else:
            group["lr"] = float(saved_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's lr in place (a tensor lr keeps its storage, which a CUDA graph reads)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
