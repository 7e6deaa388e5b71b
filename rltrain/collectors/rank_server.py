"""The body of one collector rank of a torchrun job (``collector=distributed``): serve the learner's
commands (``rank_pool``'s messages) with the rank's own collector, until the learner says close
or is gone. ``rltrain.factory.serve_rank`` builds what it serves with: the rank's collector (its
envs in this process, or lock-step worker processes fed by a relay through shared memory) and its
weights receiver.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

from rltrain import process_groups, stop_signals
from rltrain.collectors.batch import batch_key
from rltrain.collectors.rank_pool import BATCH, CLOSE, COLLECT, ERROR, LOAD, OBJECT, STATE
from rltrain.protocols import Collector
from rltrain.sync.base import FlatBuffer, WeightReceiver, WeightSender

log = logging.getLogger("rltrain")

_LEARNER_SILENCE_S = 3600.0  # a collector rank waits this long for its next command (a dead learner: at once)


class RankServer:
    """Collector rank ``world.rank``: ``collector`` fills ``buffer`` (one rank batch) per COLLECT;
    ``receiver`` brings the learner's weights (relayed to the collector's workers by ``relay``, if
    it has workers). Owns all three from here: they are closed when the rank stops. The
    constructor returns once the rank has joined the ``collect`` group and told the learner it is
    ready; a failure is reported to the learner first (it shows this rank's traceback)."""

    def __init__(self, world: process_groups.World, collector: Collector, receiver: WeightReceiver,
                 relay: WeightSender | None, buffer: FlatBuffer, timeout_s: float):
        self.world, self.collector, self.receiver, self.relay = world, collector, receiver, relay
        self.buffer, self.timeout_s = buffer, timeout_s
        self.group = None
        try:
            self.batches = iter(collector)
            self.group = process_groups.gloo_group(world.store, "collect", world.rank, world.size, timeout_s)
            hello = {"host": world.host, "pid": os.getpid(), "nbytes": buffer.buffer.numel()}
            process_groups.send_frame(self.group, 0, OBJECT, process_groups.encode(hello))
        except BaseException:
            self._report_and_close()
            raise

    def run(self) -> None:
        """Serve the learner's commands until it says close (or is gone). A stop signal (SIGINT,
        SIGTERM) waits, as worker processes ignore it: a scheduler or torchrun signals every rank at
        once, and the learner still asks this rank for its envs' state for its last checkpoint. The
        rank then exits as stopped by that signal; a second Ctrl-C stops it at once."""
        requested: list[signal.Signals] = []

        def on_request(signum: signal.Signals) -> None:
            if not requested:
                log.warning("%s: the learner saves the run, then stops this rank (Ctrl-C again to stop at once)",
                            signum.name)
            requested.append(signum)

        try:
            with stop_signals.after_step(on_request):
                self._serve()
        except BaseException:
            self._report_and_close()
            raise
        finally:
            self._close()
        if requested:  # handed to the handler that was there before (the CLI's: exit with 128 + N)
            signal.raise_signal(requested[0])

    def _serve(self) -> None:
        while True:
            try:
                kind, nbytes, arg = process_groups.recv_header(self.group, 0, _LEARNER_SILENCE_S)
                payload = process_groups.recv_payload(self.group, 0, None, nbytes, self.timeout_s)
            except RuntimeError as e:
                if process_groups.is_peer_gone(e):
                    log.error("the learner (rank 0) is gone; this collector rank stops")
                    return
                raise
            if kind == CLOSE:  # the learner's weights sender says its last word right after
                self.receiver.wait_ended(5.0)
                return
            if kind == COLLECT:
                self._collect(arg)
                process_groups.send_frame(self.group, 0, BATCH, self.buffer.buffer)
            elif kind == STATE:
                process_groups.send_frame(self.group, 0, OBJECT, process_groups.encode(self.collector.state_dict()))
            elif kind == LOAD:
                answer = self._load(process_groups.decode(payload))
                process_groups.send_frame(self.group, 0, OBJECT, process_groups.encode(answer))

    def _collect(self, version: int) -> None:
        if version >= 0:  # lock-step: act with the version pushed before this command, or newer
            self.receiver.wait_for(version)
        elif self.relay is not None:
            self.receiver.poll()
        if self.relay is not None and self.receiver.version > self.relay.version:
            self.relay.version = self.receiver.version - 1  # the workers see the learner's version numbers
            self.relay.push()
        batch = next(self.batches)
        for key, view in self.buffer.views.items():
            view.copy_(batch[batch_key(key)])

    def _load(self, state) -> str | None:
        try:
            self.collector.load_state_dict(state)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None

    def _report_and_close(self) -> None:
        """Tell the learner what failed (it shows this rank's traceback) and wait, up to
        ``timeout_s``, until it has heard (torchrun stops every rank once this one exits), then stop."""
        e = sys.exc_info()[1]
        if not isinstance(e, KeyboardInterrupt):
            what, details = f"{type(e).__name__}: {e}", f"collector rank {self.world.rank}:\n{traceback.format_exc()}"
            try:
                if self.group is not None:
                    process_groups.send_frame(self.group, 0, ERROR, process_groups.encode((what, details)))
                    process_groups.recv_header(self.group, 0, self.timeout_s)  # the learner's close, or its exit
                else:
                    report_and_wait(self.world, what, details, self.timeout_s)
            except (RuntimeError, TimeoutError):
                pass
        self._close()

    def _close(self) -> None:
        """Stop this rank's collector (its workers), relay and receiver; safe to call twice."""
        if self.collector is not None:
            self.collector.close()
            self.collector = None
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        self.receiver.close()


def report_and_wait(world: process_groups.World, what: str, details: str, timeout_s: float) -> None:
    """A rank's failure before its groups formed: through the store, until the learner saw it."""
    process_groups.report_failure(world.store, world.rank, what, details)
    try:
        process_groups.wait_for_key(world.store, f"failure_seen/{world.rank}", timeout_s)
    except TimeoutError:
        pass  # the learner may be gone itself
