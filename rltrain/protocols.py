"""The interfaces the trainer, the factory and the checkpoint code rely on: ``Algo`` and ``Collector``.

Declared here, so that a class of your own (``algo._target_``, ``collector._target_``) knows what
to provide, and so that no code in rltrain needs to probe for attributes. ``build`` checks that
the parts it makes satisfy them. A collector may subclass ``Collector`` for its defaults (no
saved state, no lag bound, use as a context manager).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tensordict import TensorDict


@runtime_checkable
class Algo(Protocol):
    """Turns collector batches into learning; its whole state goes into checkpoints.

    Capabilities (class attributes, checked by build before anything starts): ``ACTION_SPACES``,
    the action-space kinds it learns on (``rltrain.envs.spaces.ActionSpec.kind``);
    ``OBSERVATIONS``, the observation-leaf kinds (``Leaf.kind``) its networks read;
    ``NEEDS_PUSHES``, why it cannot work with a sync scheme that never pushes (None: it can);
    ``DATA_PARALLEL``, whether it learns on data-parallel ranks (``strategy=ddp``: its constructor takes
    ``strategy`` and routes its backward passes and global statistics through it), as the names of its
    keys that are global sizes each rank takes its share of (None: one process only); ``RANK_STATE``, the
    keys of its ``state_dict`` that differ between data-parallel ranks (a replay buffer of the rank's own
    frames), which checkpoints keep per rank; ``SHARDS``, whether its model can be sharded over the ranks
    (``strategy=fsdp``: it makes its optimizer after ``strategy.wrap``, takes its state dicts through the
    strategy, and has ``trained_parts()``, the modules and optimizers a sharded checkpoint writes rank by rank,
    which ``state_dict(parts=False)`` leaves out).
    """

    ACTION_SPACES = ("discrete", "box")
    OBSERVATIONS = ("vector", "discrete", "multi_discrete")
    NEEDS_PUSHES: str | None = None
    DATA_PARALLEL: tuple[str, ...] | None = None
    RANK_STATE: tuple[str, ...] = ()
    SHARDS = False

    def update(self, batch: TensorDict | None, should_stop: Callable[[], bool]) -> dict[str, float] | None:
        """Learn from ``batch``; None if ``should_stop()`` interrupted it between two gradient steps
        (``state_dict`` then holds the rest, and ``update(None, should_stop)`` finishes it)."""

    def state_dict(self, replay_buffer: bool = True) -> dict:
        """Everything a resumed run needs; ``replay_buffer=False`` leaves out a replay buffer, if any."""

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s result."""


@runtime_checkable
class Collector(Protocol):
    """Yields ``[T, N]`` TensorDict batches forever (keys: see docs/architecture.md, Batches).

    Capabilities: ``BATCH_ENVS``, the config keys whose product is the number of envs one batch
    spans (``collector.frames_per_batch`` must be a multiple of it); ``IN_LEARNER_PROCESS``, whether
    its envs and policy copy live in the learner's process (sync schemes for other processes only,
    such as ``sync=pipe``, cannot reach it); ``ON_OTHER_RANKS``, whether its envs run on the other
    ranks of a torchrun job (then the class has ``check_job(world, config)`` and ``rank_frames(config,
    ranks)``, the frames of one rank's batch, by which build sizes each rank's own collector; and
    only a sync scheme that ``REACHES_OTHER_RANKS`` can feed it); ``TASKS``, whether it collects from a
    language task (prompts) with a generation engine (``engine=``) instead of from gymnasium envs;
    ``RANK_SPLIT``, the config keys besides ``collector.frames_per_batch`` that a data-parallel learner
    (``strategy=ddp``) divides among its ranks, each rank collecting its share (None: it cannot be split);
    ``JOB_STATE``, whether its state is the whole job's, the same on every rank (a rank that a checkpoint
    has no state for, resuming with more ranks, then loads rank 0's).
    """

    BATCH_ENVS: tuple[str, ...] = ()
    IN_LEARNER_PROCESS = False
    ON_OTHER_RANKS = False
    TASKS = False
    RANK_SPLIT: tuple[str, ...] | None = None
    JOB_STATE = False

    max_lag: int | None = None  # the trainer drops batches with frames more versions old than this

    def __iter__(self) -> Iterator[TensorDict]: ...

    def close(self) -> None:
        """Stop whatever the collector started (worker processes, envs); safe to call twice."""

    def state_dict(self) -> dict | None:
        """The envs mid-episode, for checkpoints; None if they cannot be saved (they restart on resume)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s result (raises if it does not fit: the envs then start fresh)."""
        raise ValueError(f"{type(self).__name__} does not restore saved envs")

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def missing_members(cls: type, interface: type) -> list[str]:
    """The members of ``interface`` (a protocol or base class above) that class ``cls`` lacks."""
    names = [name for name in vars(interface)  # capabilities (UPPER_CASE) have defaults: not required
             if name == "__iter__" or not (name.startswith("_") or name.isupper())]
    return [name for name in names if not hasattr(cls, name)]
