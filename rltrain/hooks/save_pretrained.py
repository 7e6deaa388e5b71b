"""Writes the trained language model as a Hugging Face model dir: what ``from_pretrained`` (and vLLM)
loads, with no rltrain in the way."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from rltrain.hooks.base import Every, Hook
from rltrain.llm.model import LanguageModel
from rltrain.rules import Flag
from rltrain.state import TrainState
from rltrain.strategies import Single, Strategy

log = logging.getLogger("rltrain")


class SavePretrainedHook(Hook):
    """``<run_dir>/<dirname>``: the learner's weights (``save_pretrained``), config and tokenizer, at
    the end of the run (``at_end``) and on its schedule (``every``; null: only at the end). Each save
    replaces the last one whole (written beside it, then renamed). With LoRA adapters
    (``model.lora_rank``), the model is written with them merged, and the adapters alone beside it
    (``<run_dir>/<dirname>-adapter``: what peft's ``PeftModel.from_pretrained`` loads onto the base)."""

    phase = "checkpoint"
    RUNS_LEARNER = True  # strategy=fsdp: every rank gives its shards, rank 0 writes the whole model

    def __init__(self, policy, model: LanguageModel, run_dir: str | Path, dirname: str = "model",
                 every: Every = None, at_end: Flag = True, strategy: Strategy = Single()):
        super().__init__(every, at_end)
        self.policy, self.model, self.path, self.strategy = policy, model, Path(run_dir) / dirname, strategy

    def on_failure(self, state: TrainState, error: Exception) -> None:
        """The run failed outside the learner: the model as trained so far, where the end would write it
        (not a sharded learner's: its other ranks may be gone, and the last checkpoint holds it)."""
        if self.at_end and not self.strategy.SHARDED:
            self.on_update(state)

    def on_update(self, state: TrainState) -> None:
        policy = self._whole_policy()
        if policy is None:
            return
        tokenizer = self.model.tokenizer()
        _write_whole(self.path, lambda d: (LanguageModel.merged(policy).save_pretrained(d),
                                           tokenizer.save_pretrained(d)))
        if self.model.lora_rank:
            _write_whole(self.path.with_name(f"{self.path.name}-adapter"), policy.save_pretrained)
        log.info("model: %s (transformers' from_pretrained loads it)", self.path)

    def _whole_policy(self):
        """The learner's model, whole (a sharded learner's: gathered into a copy on rank 0; None on the others)."""
        if not self.strategy.SHARDED:
            return self.policy
        weights = self.strategy.weights(self.policy)
        if not self.strategy.is_main:
            return None
        policy = self.model.load()
        policy.load_state_dict(weights)
        return policy


def _write_whole(path: Path, write) -> None:
    """``write(dir)`` into a new dir beside ``path``, then that dir renamed to ``path`` (replacing it)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(staging)
        if path.exists():
            shutil.rmtree(path)
        staging.chmod(0o755)
        staging.replace(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
