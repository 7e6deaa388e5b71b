"""Keeps NaN and infinite losses and gradients out of the weights, without a host sync per step.

Before each optimizer step, ``check`` sets that optimizer's ``found_inf`` flag when the loss or a
gradient is not finite: fused Adam then skips the step entirely (weights, moments and step count
unchanged). This is the flag torch's GradScaler hands to fused optimizers. ``report``, once per
update, reads how many steps were skipped and raises NonFiniteError for them, unless the algo's
``nonfinite`` is ``skip`` (then they are counted: ``nonfinite/skipped_steps``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rltrain.errors import NonFiniteError

MODES = ("error", "skip")  # what a NaN/inf loss or gradient does: stop the run, or skip that step


class NonFiniteGuard:
    """One flag per optimizer (by loss name); cumulative counts of skipped steps per loss."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], mode: str, device: torch.device):
        if mode not in MODES:
            raise ValueError(f"nonfinite must be one of {MODES} (got {mode!r})")
        self.mode, self._names = mode, list(optimizers)
        self._one = torch.ones((), device=device)
        self._flags = {name: torch.zeros((), device=device) for name in optimizers}
        for name, optimizer in optimizers.items():
            if not optimizer.defaults.get("fused"):
                raise ValueError(f"the {name} optimizer must be fused to skip non-finite steps")
            optimizer.found_inf = self._flags[name]
        self.skipped = torch.zeros(len(optimizers), device=device)  # since the start of training
        self._reported = [0] * len(optimizers)

    def check(self, name: str, loss: torch.Tensor, params: Iterable[torch.Tensor] = (),
              grad_norm: torch.Tensor | None = None) -> None:
        """After ``backward``, before ``step``: flag the step of ``name``'s optimizer for skipping
        if ``loss``, ``grad_norm`` (when given) or a gradient of ``params`` is not finite."""
        flag = self._flags[name]
        if grad_norm is not None:  # a NaN/inf gradient makes the norm non-finite too
            flag.copy_(~(torch.isfinite(loss) & torch.isfinite(grad_norm)))
        else:
            flag.copy_(~torch.isfinite(loss))
            grads = [p.grad for p in params if p.grad is not None]
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, self._one)  # sets flag, scales by 1
        self.skipped[self._names.index(name)] += flag

    def report(self) -> int:
        """Steps skipped since the last report; raises NonFiniteError for them unless ``mode`` is skip."""
        totals = [int(v) for v in self.skipped.tolist()]
        new = {name: now - before for name, now, before in zip(self._names, totals, self._reported) if now > before}
        self._reported = totals
        if new and self.mode == "error":
            which = ", ".join(f"the {name} loss in {n} step{'s' * (n > 1)}" for name, n in new.items())
            raise NonFiniteError(f"a loss or its gradient was NaN or infinite ({which}); those steps were skipped, "
                                 "so the weights are still finite and the last checkpoint is usable. Look for "
                                 "extreme observations or rewards (algo.network.normalize_obs=true helps), a "
                                 "lower algo.lr, or set algo.nonfinite=skip to skip such steps and go on "
                                 "(counted as nonfinite/skipped_steps)")
        return sum(new.values())

    def state_dict(self) -> dict:
        return {"skipped": self.skipped.clone(), "reported": list(self._reported)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped.copy_(state["skipped"])
        self._reported = list(state["reported"])
