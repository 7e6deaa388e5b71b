"""Keeps NaN and infinite losses and gradients out of the weights, without a host sync per step.

Before each optimizer step, ``check`` sets that optimizer's ``found_inf`` flag when the loss or a
gradient is not finite: fused Adam then skips the step entirely (weights, moments and step count
unchanged). This is the flag torch's GradScaler hands to fused optimizers. ``report``, once per
update, reads how many steps were skipped and raises NonFiniteError for them, unless the algo's
``nonfinite`` is ``skip`` (then they are counted: ``nonfinite/skipped_steps``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import torch

from rltrain.errors import NonFiniteError
from rltrain.rules import OneOf

MODES = ("error", "skip")  # what a NaN/inf loss or gradient does: stop the run, or skip that step
NONFINITE = OneOf(MODES)
NonFinite = Annotated[str, NONFINITE]  # algo.nonfinite


class NonFiniteGuard:
    """One flag per optimizer (by loss name). Skipped steps are counted with no host work per step:
    fused Adam does not advance a skipped step's count, so steps asked for minus steps taken is
    the number skipped. The steps asked for are counted on the device, so a step replayed as a
    CUDA graph (where no Python runs) counts too."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], mode: str, device: torch.device):
        NONFINITE.check("algo.nonfinite", mode)
        self.mode, self._optimizers = mode, dict(optimizers)
        self._one = torch.ones((), device=device)
        self._flags = {name: torch.zeros((), device=device) for name in optimizers}
        for name, optimizer in optimizers.items():
            if not optimizer.defaults.get("fused"):
                raise ValueError(f"the {name} optimizer must be fused to skip non-finite steps")
            optimizer.found_inf = self._flags[name]
        # Steps asked for since the last report, one counter per optimizer, on the device.
        self._asked = torch.zeros(len(optimizers), dtype=torch.int64, device=device)
        self._counter = {name: self._asked[i] for i, name in enumerate(optimizers)}  # views, added to in place
        self._taken = {name: _steps_taken(optimizer) for name, optimizer in optimizers.items()}  # at that report

    def check(self, name: str, loss: torch.Tensor, params: Iterable[torch.Tensor] = (),
              grad_norm: torch.Tensor | None = None) -> None:
        """After ``backward``, before ``step``: flag the step of ``name``'s optimizer for skipping
        if ``loss``, ``grad_norm`` (when given) or a gradient of ``params`` is not finite."""
        flag = self._flags[name]
        # x - x is 0 for a finite x and NaN for NaN or inf: the flag becomes 1.0 exactly when not finite.
        if grad_norm is not None:  # a NaN/inf gradient makes the norm non-finite too
            torch.add(loss.detach(), grad_norm, out=flag)
            flag.sub_(flag).ne_(0)
        else:
            flag.copy_(loss.detach()).sub_(flag).ne_(0)
            grads = [p.grad for p in params if p.grad is not None]
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, self._one)  # sets flag, scales by 1
        self._counter[name].add_(1)

    def report(self) -> int:
        """Steps skipped since the last report; raises NonFiniteError for them unless ``mode`` is skip."""
        new = {}
        for (name, optimizer), asked in zip(self._optimizers.items(), self._asked.tolist()):
            taken = _steps_taken(optimizer)
            if skipped := asked - (taken - self._taken[name]):
                new[name] = skipped
            self._taken[name] = taken
        self._asked.zero_()
        if new and self.mode == "error":
            which = ", ".join(f"the {name} loss in {n} step{'s' * (n > 1)}" for name, n in new.items())
            raise NonFiniteError(f"a loss or its gradient was NaN or infinite ({which}); those steps were skipped, "
                                 "so the weights are still finite and the last checkpoint is usable. Look for "
                                 "extreme observations or rewards (algo.network.normalize_obs=true helps), a "
                                 "lower algo.lr, or set algo.nonfinite=skip to skip such steps and go on "
                                 "(counted as nonfinite/skipped_steps)")
        return sum(new.values())

    def state_dict(self) -> dict:
        return {"asked": dict(zip(self._optimizers, self._asked.tolist())), "taken": dict(self._taken)}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore ``state_dict()``'s result, after the optimizers' own; None: count from their state now."""
        if state is None:
            self._asked.zero_()
            self._taken = {name: _steps_taken(optimizer) for name, optimizer in self._optimizers.items()}
        else:
            self._asked.copy_(torch.tensor([state["asked"][name] for name in self._optimizers]))
            self._taken = dict(state["taken"])


def _steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer's step count (of its first parameter; 0 before its first step)."""
    step = optimizer.state.get(optimizer.param_groups[0]["params"][0], {}).get("step")
    return 0 if step is None else int(step)


def nonfinite_weights(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s parameters that hold a NaN or an infinity (one host sync for all). A sharded
    module's (DTensor parameters): in this rank's shards."""
    named = [(name, p.to_local() if hasattr(p, "to_local") else p) for name, p in module.named_parameters()
             if p.requires_grad]
    if not named:
        return []
    finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
    return [name for (name, _), ok in zip(named, finite) if not ok]
