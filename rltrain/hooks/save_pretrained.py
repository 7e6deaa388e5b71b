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
    replaces the last one whole (written beside it, then renamed)."""

    phase = "checkpoint"

    def __init__(self, policy, model: LanguageModel, run_dir: str | Path, dirname: str = "model",
                 every: Every = None, at_end: Flag = True):
        super().__init__(every, at_end)
        self.policy, self.model, self.path = policy, model, Path(run_dir) / dirname

    def on_update(self, state: TrainState) -> None:
        staging = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", dir=self.path.parent))
        try:
            self.policy.save_pretrained(staging)
            self.model.tokenizer().save_pretrained(staging)
            if self.path.exists():
                shutil.rmtree(self.path)
            staging.chmod(0o755)
            staging.replace(self.path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log.info("model: %s (transformers' from_pretrained loads it)", self.path)
