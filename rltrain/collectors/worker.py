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
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

import numpy as np
import torch

from rltrain.collectors.rollout import Rollout

_WAKE_S = 0.05  # while waiting: look for new weights (releasing an old slot) and for a dead learner


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
    # Ctrl-C (or a scheduler's SIGTERM) reaches the whole process group; the learner finishes its
    # step, checkpoints and then stops its workers. A worker also exits once the learner is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
    torch.manual_seed(seed)  # the policy's action sampling: lock-step runs repeat exactly
    env = None
    try:
        env = make_env()
        policy = make_policy()
        receiver.connect(policy)
        arrays = [{k: t.numpy() for k, t in slot.items()} for slot in buffers]
        serve(conn, env, policy, receiver, arrays)
    except _Closed:
        pass
    except BaseException as e:  # noqa: BLE001  (everything goes back to the learner)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}", f"collector worker {index}:\n{traceback.format_exc()}"))
        except OSError:
            pass
        sys.exit(1)
    finally:
        receiver.close()
        if env is not None:
            env.close()


def serve_lockstep(conn, env, policy, receiver, arrays: list[dict[str, np.ndarray]]) -> None:
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


def serve_async(conn, env, policy, receiver, arrays: list[dict[str, np.ndarray]]) -> None:
    """Collect non-stop into whichever buffer the learner has freed, new weights between steps."""
    rollout = Rollout(env, policy, receiver, poll_each_step=True)
    conn.send(("ready",))
    free = list(range(len(arrays)))
    while True:
        while conn.poll():
            free.append(_freed(conn.recv()))
        if not free:
            free.append(_freed(_recv(conn, receiver)))
        slot = free.pop(0)
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


def _recv(conn, receiver) -> tuple:
    """Wait for the learner's next message, applying new weights meanwhile; exit if the learner died."""
    parent = mp.parent_process()
    handles = [conn] + ([receiver.waitable] if receiver.waitable is not None else [])
    while conn not in wait(handles, timeout=_WAKE_S):
        if parent is not None and not parent.is_alive():
            raise _Closed
        receiver.poll()
    msg = conn.recv()
    if msg[0] == "close":
        raise _Closed
    return msg


def _freed(msg: tuple) -> int:
    """The slot of a ``free`` message (async workers get no other command but ``close``)."""
    if msg[0] == "close":
        raise _Closed
    return msg[1]
