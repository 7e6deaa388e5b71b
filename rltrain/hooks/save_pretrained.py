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

log = logging.getLogger("rltrain")


class SavePretrainedHook(Hook):
    """``<run_dir>/<dirname>``: the learner's weights (``save_pretrained``), config and tokenizer, at
    the end of the run (``at_end``) and on its schedule (``every``; null: only at the end). Each save
    replaces the last one whole (written beside it, then renamed). With LoRA adapters
    (``model.lora_rank``), the model is written with them merged, and the adapters alone beside it
    (``<run_dir>/<dirname>-adapter``: what peft's ``PeftModel.from_pretrained`` loads onto the base)."""

    phase = "checkpoint"

    def __init__(self, policy, model: LanguageModel, run_dir: str | Path, dirname: str = "model",
                 every: Every = None, at_end: Flag = True):
        super().__init__(every, at_end)
        self.policy, self.model, self.path = policy, model, Path(run_dir) / dirname

    def on_failure(self, state: TrainState, error: Exception) -> None:
        """The run failed outside the learner: the model as trained so far, where the end would write it."""
        if self.at_end:
            self.on_update(state)

    def on_update(self, state: TrainState) -> None:
        tokenizer = self.model.tokenizer()
        _write_whole(self.path, lambda d: (LanguageModel.merged(self.policy).save_pretrained(d),
                                           tokenizer.save_pretrained(d)))
        if self.model.lora_rank:
            _write_whole(self.path.with_name(f"{self.path.name}-adapter"), self.policy.save_pretrained)
        log.info("model: %s (transformers' from_pretrained loads it)", self.path)


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
