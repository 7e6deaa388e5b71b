"""How far ahead of the learner worker processes may collect (``collector.max_lag``): counts in
shared memory that the workers and the learner keep together."""

from __future__ import annotations

import torch


class Backlog:
    """Counts in shared memory, each cell with one writer: batches ``started[i]`` by worker i (from
    the moment it starts collecting one), ``taken[i]`` from it by the learner, and ``finished``,
    those the learner has updated on and pushed weights after. A batch started now has every
    unfinished batch ahead of it, each followed by a push before its turn: it would be that many
    versions old, so over ``max_lag`` the worker waits instead of collecting what would be dropped."""

    def __init__(self, workers: int, max_lag: int):
        self.max_lag = max_lag
        self.started = torch.zeros(workers, dtype=torch.int64).share_memory_()
        self.taken = torch.zeros(workers, dtype=torch.int64).share_memory_()
        self.finished = torch.zeros(1, dtype=torch.int64).share_memory_()

    def too_long(self, worker: int) -> bool:
        """Whether worker ``worker`` should wait rather than start a batch now. Never when nothing
        is ahead (an idle learner always gets a batch); otherwise when the batch would be over
        ``max_lag``, or the worker already has one waiting (so that a slow worker's batch is
        overtaken by at most one batch per other worker)."""
        ahead = int(self.started.sum() - self.finished)
        mine = int(self.started[worker] - self.taken[worker])
        return ahead > 0 and (ahead > self.max_lag or mine > 0)
