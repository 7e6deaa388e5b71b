"""One invocation's settings, its peers and the runners they use; and ``compare``, which times the
same case in several libraries, alternating rounds between them."""

from __future__ import annotations

from benchmarks.core import OURS, Stat, find_peer
from benchmarks.runner import LocalRunner, ProcessRunner

ROUNDS_QUICK, ROUNDS_FULL = 3, 10


class Context:
    """What a category needs to know about this invocation, and the runners its cases use."""

    def __init__(self, quick: bool, compare: list[str], peer_python: str | None, threads: int, device: str = "cpu",
                 trl_python: str | None = None):
        self.quick, self.threads, self.device = quick, threads, device
        # TRL has a Python of its own when asked (--trl-python): its venv is not the other peers'
        self.peers = {name: find_peer(name, trl_python if name == "trl" and trl_python else peer_python)
                      for name in compare}
        self.rounds = ROUNDS_QUICK if quick else ROUNDS_FULL
        self._runners: dict[str | None, object] = {}

    def peer(self, name: str):
        """The peer if it was asked for (``--compare``) and can run; None otherwise."""
        peer = self.peers.get(name)
        return peer if peer and not peer.missing else None

    def peer_notes(self, *names: str) -> list[str]:
        return [f"{n}: {self.peers[n].missing}" for n in names if n in self.peers and self.peers[n].missing]

    def runner(self, column: str):
        """Where ``column``'s cases run: in a peer's own Python if it has one, else in this process
        (rltrain's columns, peers importable here, and anchors written in plain torch)."""
        peer = self.peer(column) if column != OURS else None
        python = peer.python if peer is not None else None
        if python not in self._runners:
            self._runners[python] = LocalRunner(self.threads) if python is None else ProcessRunner(python, self.threads)
        return self._runners[python]

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()

    def compare(self, cases: dict[str, tuple[str, dict]], reps: int, per_call: int = 1, warmup: int = 3,
                notes: list[str] | None = None) -> dict[str, Stat | None]:
        """Time each column's case (``column -> (ref, kwargs)``), alternating ``self.rounds`` rounds of
        ``reps`` samples between the columns; ms per call. A column whose case fails gets None and
        its error in ``notes``."""
        live = self.setup(cases, notes)
        samples = {c: [] for c in live}
        try:
            for round_ in range(1 + self.rounds):  # a warm-up round, then rounds alternating between columns
                for column, (runner, handle) in list(live.items()):
                    try:
                        times = runner.time(handle, warmup if round_ == 0 else reps, per_call)
                    except Exception as e:  # noqa: BLE001  a library failing mid-way loses its cell only
                        _note(notes, column, e)
                        self.drop({column: live.pop(column)})
                        del samples[column]
                        continue
                    if round_ > 0:
                        samples[column] += [s * 1e3 for s in times]
        finally:
            self.drop(live)
        return {c: Stat(samples[c]) if samples.get(c) else None for c in cases}

    def setup(self, cases: dict[str, tuple[str, dict]], notes: list[str] | None) -> dict[str, tuple]:
        """Build each column's case where it runs: ``column -> (runner, handle)``; failures go to notes."""
        live = {}
        for column, (ref, kwargs) in cases.items():
            try:
                runner = self.runner(column)
                live[column] = runner, runner.setup(ref, **kwargs)
            except Exception as e:  # noqa: BLE001  one library's failure leaves its cell empty
                _note(notes, column, e)
        return live

    def outputs(self, cases: dict[str, tuple[str, dict]], notes: list[str] | None = None) -> dict[str, object]:
        """Each column's case output (its step called once), as plain lists."""
        live, out = self.setup(cases, notes), {}
        try:
            for column, (runner, handle) in live.items():
                try:
                    out[column] = runner.output(handle)
                except Exception as e:  # noqa: BLE001
                    _note(notes, column, e)
        finally:
            self.drop(live)
        return out

    @staticmethod
    def drop(live: dict[str, tuple]) -> None:
        for runner, handle in live.values():
            try:
                runner.drop(handle)
            except Exception:  # noqa: BLE001  a worker that died has nothing left to drop
                pass


def _note(notes: list[str] | None, column: str, error: Exception) -> None:
    lines = str(error).strip().splitlines()
    if notes is not None:
        notes.append(f"{column} failed: {lines[-1] if lines else type(error).__name__}")
