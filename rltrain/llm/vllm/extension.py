"""The worker extension a vLLM server runs with for rltrain (``--worker-extension-cls``): what rltrain calls
through the server's ``/collective_rpc`` (``rltrain_info``, the claim, ``rltrain_load``), and the address
of a ``sync=vllm`` slot by which the server's worker maps it for one load (``slot_address``, ``open_slot``).
Imports nothing of vLLM's at import time.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from rltrain.llm.vllm.claim import ClaimLedger, describe, public, sees
from rltrain.llm.vllm.loading import quiet_reloads

EXTENSION = "rltrain.llm.vllm.extension.WorkerExtension"  # --worker-extension-cls
PROTOCOL = 2  # the extension's methods and what they take; a server running another rltrain's extension is refused
def slot_address(slot) -> dict:
    """Where another process of this machine (and user) maps ``slot`` (a shared FlatBuffer): the path
    of its shared-memory file under /proc, its size, and each weight's place in it."""
    fd, nbytes = slot.file()
    stat = os.fstat(fd)
    return {"protocol": PROTOCOL, "path": f"/proc/{os.getpid()}/fd/{fd}", "nbytes": nbytes,
            "file": [stat.st_dev, stat.st_ino],  # what the path must name where the server opens it
            "weights": [[name, list(shape), str(dtype).removeprefix("torch."), slot.offset(name)]
                        for name, (shape, dtype) in slot.layout.items()]}


def open_slot(address: dict) -> dict[str, torch.Tensor]:
    """The weights of ``slot_address``'s slot, read in place (a shared mapping of the learner's file);
    OSError where this process cannot open it, or the path names another file here (another pid
    namespace: another machine or container)."""
    stat = os.stat(address["path"])
    if [stat.st_dev, stat.st_ino] != address["file"] or stat.st_size != address["nbytes"]:
        raise OSError(f"{address['path']} is not the learner's slot here")
    storage = torch.UntypedStorage.from_file(address["path"], shared=True, nbytes=address["nbytes"])
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    views = {}
    for name, shape, dtype, offset in address["weights"]:
        dtype = getattr(torch, dtype)
        count = torch.Size(shape).numel()
        views[name] = buffer[offset:offset + count * dtype.itemsize].view(dtype).view(shape)
    return views


class WorkerExtension:
    """Mixed into vLLM's worker by ``--worker-extension-cls rltrain.llm.vllm.extension.WorkerExtension``: what
    rltrain calls through the server's ``/collective_rpc``. Imports nothing of vLLM's at import time."""

    def rltrain_info(self) -> dict:
        config = self.model_runner.model_config
        transfer = getattr(self.vllm_config, "weight_transfer_config", None)
        return {"protocol": PROTOCOL, "model": config.model, "logprobs_mode": str(config.logprobs_mode),
                "dtype": str(config.dtype), "pid": os.getpid(), "holder": public(self._rltrain_claims().holder()),
                "weight_transfer": None if transfer is None else transfer.backend}

    def rltrain_claim(self, holder: str) -> dict:
        """Take the server for the run ``holder`` names (``holder()``'s, as JSON), or renew its claim:
        ``{"leased": ...}`` (whether the claim lapses unless renewed), or ``{"held": ...}``, the other run
        that holds it."""
        quiet_reloads()  # the first thing a run asks: vLLM's lines of each reload are shown once from now on
        holder = json.loads(holder)
        claims = self._rltrain_claims()
        if (held := claims.claim(holder)) is not None:
            return {"held": held}
        return {"leased": not sees(holder)}

    def rltrain_release(self, token: str) -> dict:
        self._rltrain_claims().release(token)
        return {"released": token}

    def _rltrain_claims(self) -> ClaimLedger:
        if getattr(self, "_rltrain_ledger", None) is None:
            self._rltrain_ledger = ClaimLedger()
        return self._rltrain_ledger

    def rltrain_load(self, address: str, token: str) -> dict:
        """Load the learner's slot at ``address`` (``slot_address``'s, as JSON) into the model in place, for
        the run holding the claim ``token``; a refusal comes back as ``{"error": ..., "kind": "map" | "claim" |
        "weights"}`` (the learner raises it). The slot is mapped for this load only: the server keeps nothing
        of a learner between pushes, so a learner that dies leaves none of its memory held here."""
        from rltrain.llm.vllm.loading import VLLMModel

        claims = self._rltrain_claims()
        if not claims.holds(token):
            held = claims.holder()
            return {"kind": "claim", "error": "this run does not hold the server any more (restarted since, or its "
                                              "claim lapsed)" + (f"; {describe(held)} does" if held else "")}
        address = json.loads(address)
        try:
            weights = open_slot(address)
        except OSError as e:
            return {"kind": "map", "error": f"it cannot map the learner's weight slot {address['path']} ({e}); it "
                                            "must run on the learner's machine (not in another container), as "
                                            "the learner's user"}
        if getattr(self, "_rltrain_model", None) is None:
            self._rltrain_model = VLLMModel(self.model_runner.get_model(), self.model_runner.model_config)
        try:
            self._rltrain_model.load(weights)
        except ValueError as e:
            return {"kind": "weights", "error": str(e)}
        return {"loaded": address["path"]}


if "vllm" in sys.modules:  # imported by vLLM's worker (the extension): rltrain's gloo backend into vLLM's factories
    import rltrain.llm.vllm.backends  # noqa: E402, F401
