"""The ``model`` config node: which causal LM is the policy, in what precision, and how a task's
prompt becomes the text it reads.

``path`` is a local model dir (``save_pretrained``'s: weights, config, tokenizer), a Hugging Face hub
id that transformers downloads (``Qwen/Qwen2.5-0.5B-Instruct``), or ``tiny``: rltrain's tiny model
(random weights, a character-level tokenizer; ``arch`` picks Qwen2 or Llama), made on first use in
``$RLTRAIN_CACHE`` (default ``~/.cache/rltrain``). ``check()`` refuses what cannot load before anything
does; ``load()`` and ``tokenizer()`` load it.

``lora_rank`` > 0 trains LoRA adapters (peft: ``pip install 'rltrain[lora]'``) of that rank on
``lora_targets`` instead of every weight; the learner and the engine both hold the adapters, the
weight sync moves them with the rest, and the model written at the end has them merged.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from typing import Annotated

import torch

from rltrain.errors import ConfigError
from rltrain.rules import Flag, Fraction, NonNegativeInt, OneOf, PositiveNumber

TINY = "tiny"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE = OneOf(tuple(DTYPES))
ARCH = OneOf(("qwen2", "llama"))
INSTALL = "pip install 'rltrain[llm]' (transformers)"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def require_transformers(key: str) -> None:
    """A ConfigError naming ``key`` and the install when transformers is missing."""
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"{key} needs transformers, which is not installed: {INSTALL}")


class LanguageModel:
    """A causal LM and its tokenizer, by ``path`` (see the module docstring).

    ``chat_template``: wrap each prompt in the tokenizer's chat template as one user message, with the
    assistant's turn opened (for instruct models); a tokenizer without one gets the prompt as it is.
    """

    def __init__(self, path: str = TINY, dtype: Annotated[str, DTYPE] = "float32", chat_template: Flag = True,
                 arch: Annotated[str, ARCH] = "qwen2", lora_rank: NonNegativeInt = 0, lora_alpha: PositiveNumber = 16,
                 lora_dropout: Fraction = 0.0, lora_targets: str | list[str] = "all-linear"):
        self.path, self.dtype, self.chat_template, self.arch = str(path), dtype, chat_template, arch
        self.lora_rank, self.lora_alpha, self.lora_dropout = lora_rank, lora_alpha, lora_dropout
        self.lora_targets = lora_targets

    def check(self) -> None:
        """Refuse, naming ``model.path`` and the fix, a model that cannot load: transformers missing,
        a local dir that does not exist, has no config.json or no tokenizer."""
        require_transformers(f"model.path={self.path}")
        if self.lora_rank and importlib.util.find_spec("peft") is None:
            raise ConfigError(f"model.lora_rank={self.lora_rank} trains LoRA adapters with peft, which is not "
                              "installed: pip install 'rltrain[lora]' (or model.lora_rank=0: every weight trains)")
        if self.path == TINY:
            return
        local = Path(self.path).expanduser()
        if not local.exists():
            if _HUB_ID.match(self.path) and not self.path.startswith((".", "/", "~")):
                return  # a hub id: transformers downloads it (or finds it in its cache)
            raise ConfigError(f"model.path={self.path}: no such dir, and not a Hugging Face hub id (org/name); give "
                              f"a save_pretrained dir, a hub id, or model.path={TINY}")
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path={self.path} has no config.json: not a transformers model dir (write one "
                              "with save_pretrained, or python -m rltrain.llm.tiny DIR)")
        if not any((local / name).is_file() for name in _TOKENIZER_FILES):
            raise ConfigError(f"model.path={self.path} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
                              "save the tokenizer there too: tokenizer.save_pretrained(DIR)")

    def source(self) -> str:
        """What transformers loads: the dir or hub id (``tiny``: the cached tiny model, made if missing)."""
        if self.path == TINY:
            from rltrain.llm.tiny import tiny_model_dir

            return str(tiny_model_dir(f"tiny-{self.arch}", self.arch))
        local = Path(self.path).expanduser()
        return str(local) if local.exists() else self.path

    def load(self, device: str | torch.device = "cpu"):
        """The model on ``device``, in ``dtype``, in eval mode (the learner switches to train mode for
        its passes; generation never does)."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per load would fill the run's log
        model = AutoModelForCausalLM.from_pretrained(self.source(), dtype=DTYPES[self.dtype]).to(device).eval()
        if not self.lora_rank:
            return model
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha,
                                                lora_dropout=self.lora_dropout, target_modules=self.lora_targets,
                                                task_type="CAUSAL_LM")).eval()

    @staticmethod
    def merged(model):
        """A plain transformers model with ``model``'s LoRA adapters merged into its weights (a copy;
        ``model`` itself stays as it is); ``model`` itself when it has no adapters."""
        if not hasattr(model, "merge_and_unload"):
            return model
        return copy.deepcopy(model).merge_and_unload()

    def tokenizer(self):
        """The model's tokenizer, padding on the left (prompts end where generation starts); a
        tokenizer without a pad token pads with its eos token."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.source(), padding_side="left")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok

    def prompt_text(self, tokenizer, prompt: str) -> str:
        """What the model reads for a task's ``prompt``: the chat template's user turn when
        ``chat_template`` and the tokenizer has one, else the prompt as it is."""
        if not self.chat_template or not getattr(tokenizer, "chat_template", None):
            return prompt
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)


def base_model(model):
    """The transformers model itself: under a peft model (LoRA), the model it wraps."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
