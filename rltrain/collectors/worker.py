"""The body of one collector worker process: build env and policy, connect weights, then serve
the learner with one of two loops (``serve_lockstep``, ``serve_async``), chosen by the collector.

Messages on the worker's pipe, learner -> worker: ``("collect",)`` (lock-step), ``("free", slot)``
(async: the learner has copied that buffer out), ``("state",)`` and ``("load", state)`` (lock-step,
between batches: for checkpoints), ``("close",)``. Worker -> learner: ``("ready",)``,
``("batch", slot)``, ``("state", state)``, ``("loaded", error_or_None)``, ``("error", what,
traceback_text)`` (``what``: the exception's type and message, e.g. the env's own error). Frames
travel through the shared-memory buffers, never through the pipe.

Only torch, numpy, gymnasium and rltrain's env, policy, rollout and sync modules are imported here
(no Hydra, no tensordict): a spawned worker starts in about torch's own import time.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Callable
from multiprocessing.connection import wait

import numpy as np
import torch

from rltrain import lazy_dynamo
from rltrain.collectors.backlog import Backlog
from rltrain.collectors.rollout import Rollout
from rltrain.errors import send_failure
from rltrain.process_groups import exit_without_teardown

_WAKE_S = 0.05  # while waiting: look for new weights (releasing an old slot) and for a dead learner
_BACKLOG_WAKE_S = 0.002  # while held back by the backlog: look this often whether the learner took a batch


class _Closed(Exception):
    """The learner asked the worker to stop, or is gone."""


def worker_main(
    index: int,
    conn,
    make_env: Callable,
    make_policy: Callable,
    receiver,
    buffers: list[dict[str, torch.Tensor]],
    serve: Callable,
    seed: int = 0,
) -> None:
    lazy_dynamo.install()  # the process is rltrain's: a policy or env importing tensordict pays no dynamo
    # Ctrl-C (or a scheduler's SIGTERM) reaches the whole process group; the learner finishes its
    # step, checkpoints and then stops its workers. A worker also exits once the learner is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    torch.manual_seed(seed)  # the policy's action sampling: lock-step runs repeat exactly
    env, code = None, 0
    try:
        env = make_env()
        policy = make_policy()
        receiver.connect(policy)
        arrays = [{k: t.numpy() for k, t in slot.items()} for slot in buffers]
        serve(index, conn, env, policy, receiver, arrays)
    except _Closed:
        pass
    except BaseException as e:  # noqa: BLE001  (everything goes back to the learner)
        send_failure(conn, f"collector worker {index}", e)
        code = 1
    finally:
        receiver.close()
        if env is not None:
            env.close()
    exit_without_teardown(code)  # a receiver's thread may still wait in gloo (sync=distributed)


def serve_lockstep(index: int, conn, env, policy, receiver, arrays: list[dict[str, np.ndarray]]) -> None:
    """One batch per ``collect`` command, new weights applied before each; states on request."""
    rollout = Rollout(env, policy, receiver)
    conn.send(("ready",))
    while True:
        msg = _recv(conn, receiver)
        if msg[0] == "collect":
            rollout.collect(arrays[0])
            conn.send(("batch", 0))
        elif msg[0] == "state":
            conn.send(("state", _save(rollout)))
        elif msg[0] == "load":
            conn.send(("loaded", _load(rollout, msg[1])))


def serve_async(index: int, conn, env, policy, receiver, arrays: list[dict[str, np.ndarray]],
                backlog: Backlog | None = None) -> None:
    """Collect non-stop into whichever buffer the learner has freed, new weights between steps;
    with a ``backlog``, hold off while a batch collected now would be too old when its turn came."""
    rollout = Rollout(env, policy, receiver, poll_each_step=True)
    conn.send(("ready",))
    free = list(range(len(arrays)))
    while True:
        while conn.poll():
            free.append(_freed(conn.recv()))
        if not free:
            free.append(_freed(_recv(conn, receiver)))
        if backlog is not None:
            while backlog.too_long(index):  # wait for the learner to take a batch (and push newer weights)
                if (msg := _recv(conn, receiver, until=lambda: not backlog.too_long(index))) is not None:
                    free.append(_freed(msg))
        slot = free.pop(0)
        if backlog is not None:
            backlog.started[index] += 1  # counted from its start: the other workers see it coming
        rollout.collect(arrays[slot])
        conn.send(("batch", slot))


def _save(rollout: Rollout) -> dict | None:
    """The worker's share of a checkpoint: its envs mid-episode and its sampling generator."""
    envs = rollout.state_dict()
    return None if envs is None else {"rollout": envs, "torch_rng": torch.get_rng_state()}


def _load(rollout: Rollout, state: dict) -> str | None:
    """Restore ``_save``'s state; on failure keep the fresh envs and return why (the worker lives on)."""
    try:
        rollout.load_state_dict(state["rollout"])
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    torch.set_rng_state(state["torch_rng"])
    return None


def _recv(conn, receiver, until: Callable[[], bool] | None = None) -> tuple | None:
    """Wait for the learner's next message (or, with ``until``, for that to turn true: then None),
    applying new weights meanwhile; exit if the learner died."""
    parent = mp.parent_process()
    handles = [conn] + ([receiver.waitable] if receiver.waitable is not None else [])
    while conn not in wait(handles, timeout=_WAKE_S if until is None else _BACKLOG_WAKE_S):
        if parent is not None and not parent.is_alive():
            raise _Closed
        receiver.poll()
        if until is not None and until():
            return None
    msg = conn.recv()
    if msg[0] == "close":
        raise _Closed
    return msg


def _freed(msg: tuple) -> int:
    """The slot of a ``free`` message (async workers get no other command but ``close``)."""
    if msg[0] == "close":
        raise _Closed
    return msg[1]
