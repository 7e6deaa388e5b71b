"""What ``LockstepRankCollector`` and ``AsyncRankCollector`` share: the learner's side of the
``collect`` group (commanding the collector ranks, their batch buffers, naming one that raises,
dies or stops answering), the messages on that group, and the config checks of a job.

Messages on the group: learner -> rank ``COLLECT`` (argument: the version to act with at least,
-1: the newest there is), ``STATE``, ``LOAD`` (payload: a state), ``CLOSE``; rank -> learner
``BATCH`` (payload: the frames, one flat buffer), ``OBJECT`` (ready, a state, a load's outcome) and
``ERROR`` (what and the traceback). The rank's side is ``rltrain.collectors.rank_server``.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading

import numpy as np
import torch

from rltrain import process_groups
from rltrain.collectors.batch import batch_steps
from rltrain.collectors.rollout import frame_layout
from rltrain.envs.spaces import EnvSpec
from rltrain.errors import CollectorError, ConfigError
from rltrain.protocols import Collector
from rltrain.sync.base import FlatBuffer

log = logging.getLogger("rltrain")

COLLECT, STATE, LOAD, CLOSE = 1, 2, 3, 4  # learner -> rank
BATCH, OBJECT, ERROR = 1, 2, 3  # rank -> learner


def collector_ranks(world: process_groups.World | None) -> int:
    """The number of collector ranks of this torchrun job, or ConfigError outside one."""
    if world is None:
        raise ConfigError("collector=distributed runs collectors on the other ranks of a torchrun job, but this "
                          "process is not in one (WORLD_SIZE is unset or 1); launch with torchrun --nproc-per-node=3 "
                          "-m rltrain collector=distributed sync=distributed (rank 0 learns, the rest collect), or "
                          "use collector=lockstep|async on one machine")
    return world.size - 1


def check_rank_batch(frames_per_batch: int, span: int, what: str, how_many: str, envs_per_rank: int,
                     workers_per_rank: int) -> None:
    """ConfigError for a batch that the ``span`` envs it gathers (``what``, in config keys, and
    ``how_many`` of them) do not divide, or envs that do not split evenly over a rank's workers."""
    batch_steps(frames_per_batch, span, what, how_many)
    if workers_per_rank and envs_per_rank % workers_per_rank:
        raise ConfigError(f"collector.envs_per_rank ({envs_per_rank}) must be a multiple of collector.workers_per_rank "
                          f"({workers_per_rank}): each worker steps the same number of envs")


def frame_buffer(spec: EnvSpec, steps: int, envs: int, state_size: int = 0) -> FlatBuffer:
    """One flat buffer with a view per frame key: a batch travels as one message."""
    layout = {k: (shape, torch.from_numpy(np.zeros(0, dtype)).dtype)
              for k, (shape, dtype) in frame_layout(spec, steps, envs, state_size).items()}
    return FlatBuffer(layout, shared=False)


class RankPool:
    """The collector ranks of this torchrun job (ranks 1 to N), as the learner (rank 0) sees them:
    one batch buffer of ``steps`` x ``envs_per_rank`` frames each; every wait bounded by
    ``timeout_s``. The constructor returns once every rank has joined and said it is ready."""

    def __init__(self, world: process_groups.World, env_spec: EnvSpec, steps: int, envs_per_rank: int, timeout_s: float,
                 kind: str, state_size: int = 0):
        self.timeout_s = timeout_s
        self.ranks = list(range(1, world.size))
        self.frame_keys = list(frame_layout(env_spec, 1, 1, state_size))
        self._buffers = {r: frame_buffer(env_spec, steps, envs_per_rank, state_size) for r in self.ranks}
        self._done: queue.Queue = queue.Queue()
        self.receiving: dict[int, threading.Thread] = {}  # the batch each rank commanded in the background sends
        self._owed: set[int] = set()  # ranks commanded whose answer was not read yet
        self.lost: set[int] = set()  # ranks that died or stopped answering
        self.who = {r: f"rank {r}" for r in self.ranks}
        try:
            # The watch has a store connection of its own: the join's waits hold the job's for up to timeout_s.
            watch = functools.partial(process_groups.raise_failures, world.address.connect(timeout_s), self.ranks)
            self._group = process_groups.gloo_group(world.store, "collect", 0, world.size, timeout_s, watch=watch)
        except TimeoutError as e:
            raise CollectorError(f"collector=distributed: the collector ranks did not all join within {timeout_s:g}s "
                                 f"(collector.timeout_s): {e}") from None
        for r in self.ranks:
            info = self.receive(r, OBJECT)
            self.who[r] = f"rank {r} ({info['host']}, pid {info['pid']})"
            if info["nbytes"] != self._buffers[r].buffer.numel():
                raise CollectorError(f"collector rank {r}'s batches have {info['nbytes']} bytes, the learner expects "
                                     f"{self._buffers[r].buffer.numel()}: do all ranks run the same config?")
        log.info("collector=distributed: %d collector ranks (%s), %s", len(self.ranks), ", ".join(self.who.values()),
                 kind)

    def frames(self, r: int) -> dict[str, torch.Tensor]:
        """Rank ``r``'s last batch, as views of its buffer (valid until it is commanded again)."""
        return self._buffers[r].views

    def command(self, r: int, kind: int, payload: torch.Tensor | None = None, arg: int = 0) -> None:
        try:
            process_groups.send_frame(self._group, r, kind, payload, arg)
        except RuntimeError as e:
            raise self._failure(r, e) from None
        self._owed.add(r)  # until its answer is read: a rank sending it cannot take another message

    def receive(self, r: int, expect: int):
        """The next message from rank ``r``: its batch (into its buffer) or an object; raises
        CollectorError for the rank's error, its death, or its silence past ``timeout_s``."""
        try:
            kind, nbytes, _ = process_groups.recv_header(self._group, r, self.timeout_s)
            into = self._buffers[r].buffer if kind == BATCH else None
            payload = process_groups.recv_payload(self._group, r, into, nbytes, self.timeout_s)
        except RuntimeError as e:
            raise self._failure(r, e) from None
        finally:
            self._owed.discard(r)
        if kind == ERROR:
            what, details = process_groups.decode(payload)
            raise CollectorError(f"collector {self.who[r]} failed: {what}", details=details)
        if kind != expect:
            raise CollectorError(f"collector {self.who[r]} sent message {kind} while the learner waited for {expect}")
        return None if kind == BATCH else process_groups.decode(payload)

    def _failure(self, r: int, e: RuntimeError) -> CollectorError:
        self.lost.add(r)
        if process_groups.is_peer_gone(e):
            return CollectorError(f"collector {self.who[r]} died (its connection closed; killed, or out of memory? "
                                  f"see ranks/{r}.log in the run dir and that machine's dmesg)")
        return CollectorError(f"collector {self.who[r]} sent nothing within {self.timeout_s:g}s "
                              "(collector.timeout_s): "
                              f"alive but stuck (an env step that never returns?), or its machine is unreachable. If "
                              f"the env is just slow, raise collector.timeout_s ({str(e).splitlines()[0]})")

    def receive_in_background(self, r: int) -> None:
        """Receive rank ``r``'s batch on a thread of its own; ``next_done`` says when it is in."""
        def run():
            try:
                self.receive(r, BATCH)
                self._done.put((r, None))
            except BaseException as e:  # noqa: BLE001  (handed to the learner's thread)
                self._done.put((r, e))
        self.receiving[r] = threading.Thread(target=run, name=f"rltrain-recv-{r}", daemon=True)
        self.receiving[r].start()

    def next_done(self) -> int:
        """The next rank whose background batch is in (raising what its receive raised)."""
        try:
            r, error = self._done.get(timeout=self.timeout_s + 5.0)  # each receive has its own timeout_s
        except queue.Empty:
            raise CollectorError(f"no collector rank answered within {self.timeout_s:g}s "
                                 "(collector.timeout_s)") from None
        if error is not None:
            raise error
        return r

    def any_done(self) -> bool:
        return not self._done.empty()

    def ask(self, r: int, kind: int) -> bool:
        """Command rank ``r``; False if it is gone (a warning, not an error: see ``answer``)."""
        try:
            self.command(r, kind)
        except CollectorError:
            return False
        return True

    def answer(self, r: int):
        """Rank ``r``'s object answer, or None (logged) if it failed to give one."""
        try:
            return self.receive(r, OBJECT)
        except CollectorError as e:
            log.warning("%s", e)
            return None

    def drop_owed_answers(self) -> None:
        """Read and drop the answers of ranks commanded but not heard yet (a rank sending one takes no
        other message); ranks that died or stopped answering are left out (they would wait out the
        timeout)."""
        for r in sorted(self._owed - set(self.receiving) - self.lost):
            try:
                self.receive(r, BATCH)
            except CollectorError:
                pass

    def close(self) -> None:
        """Tell every rank still there to stop; safe to call twice."""
        self.drop_owed_answers()
        for r in [r for r in self.ranks if r not in self.lost]:
            try:
                process_groups.send_frame(self._group, r, CLOSE)
            except RuntimeError:
                pass  # already gone
        # Batches still on their way: a thread left waiting in gloo would abort this process's exit.
        for thread in self.receiving.values():
            thread.join(min(self.timeout_s, 10.0))
        self.ranks, self.receiving = [], {}


class RankCollector(Collector):
    """What the lock-step and async rank collectors share: the job checked against the config (their
    ``check_job``), and one ``RankPool`` of the collector ranks, each collecting ``rank_frames`` per
    batch (``KIND`` names the mode in messages)."""

    BATCH_ENVS = ("collector.envs_per_rank",)
    ON_OTHER_RANKS = True
    KIND = ""

    def __init__(self, env_spec: EnvSpec, frames_per_batch: int, sender=None, envs_per_rank: int = 8,
                 workers_per_rank: int = 0, max_lag: int | None = 2, start_method: str = "spawn",
                 timeout_s: float = 60.0, state_size: int = 0):
        # workers_per_rank and start_method are the ranks' own (factory.serve_rank builds their collectors).
        world = process_groups.current()
        config = {"frames_per_batch": frames_per_batch, "envs_per_rank": envs_per_rank,
                  "workers_per_rank": workers_per_rank}
        self.check_job(world, config)
        self.frames_per_batch, self.max_lag, self._sender = frames_per_batch, max_lag, sender
        steps = self.rank_frames(config, collector_ranks(world)) // envs_per_rank
        self.pool = RankPool(world, env_spec, steps, envs_per_rank, timeout_s, self.KIND, state_size)

    def close(self) -> None:
        self.pool.close()
