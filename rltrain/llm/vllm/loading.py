"""Loading the learner's weights into vLLM's model, in whichever process holds it (rltrain's engine, a
server's worker): what is served of a transformers model (``served_weights``, or a LoRA learner's
adapters alone: ``adapter_weights``), the in-place reload (``VLLMModel``), the adapters as vLLM applies
them (``VLLMAdapters``), and the checks of weight names against the served model's checkpoint.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn


@torch.no_grad()
def served_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an inference engine loads of a transformers ``model``: its parameters by their Hugging Face
    names; for a peft model (LoRA), its base weights with the adapters merged in (computed at each
    call: ``model`` stays as it is), never the base weights alone."""
    if not hasattr(model, "get_base_model"):
        return {name: p.detach() for name, p in model.named_parameters()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    weights = {name.replace(".base_layer.", "."): p.detach() for name, p in base.named_parameters()
               if ".lora_" not in name}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            deltas = [module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A]
            if deltas:
                weights[f"{name}.weight"] = weights[f"{name}.weight"] + sum(deltas)
    return weights


ADAPTER_MARK = ".lora_A."  # in the name of every adapter weight peft writes (and nothing else)


def adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A peft model's (LoRA) adapter weights, by the names of the adapter files peft writes and vLLM loads
    (``...q_proj.lora_A.weight``: without the adapter's own name)."""
    from peft import get_peft_model_state_dict

    return {name: t.detach() for name, t in get_peft_model_state_dict(model).items()}


def holds_adapters(names) -> bool:
    """Whether weights of these names are LoRA adapters (``adapter_weights``), not a whole model."""
    return any(ADAPTER_MARK in name for name in names)


class VLLMAdapters:
    """The learner's LoRA adapters in rltrain's vLLM engine (``sync=vllm`` with ``sync.adapters=true``): vLLM keeps
    the base model and applies each pushed version as an adapter of its own. A version is written as peft's
    adapter files in a directory of its own under ``folder`` (vLLM loads adapters from files) and registered
    under a name and id of its own (vLLM caches an adapter by its id, and prefix-caches keys and values by its
    name and path: reusing either would serve the previous version); the version before it is removed."""

    def __init__(self, llm, rank: int, alpha: float, folder: str | Path):
        self.llm, self.rank, self.alpha, self.folder = llm, rank, alpha, Path(folder)
        self.request = None  # the LoRARequest every generation carries: the newest version's

    def load_slot(self, slot, version: int) -> None:
        """Load a ``sync=vllm`` slot of adapter weights as version ``version``; ValueError if vLLM refuses them."""
        import json

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        path = self.folder / f"v{version}"
        path.mkdir(parents=True)
        save_file({name: view.clone() for name, view in slot.views.items()}, path / "adapter_model.safetensors")
        targets = sorted({name.split(ADAPTER_MARK)[0].rsplit(".", 1)[-1] for name in slot.views
                          if ADAPTER_MARK in name})
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
            "target_modules": targets, "bias": "none", "lora_dropout": 0.0, "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "modules_to_save": None}))
        request = LoRARequest(f"rltrain-v{version}", version + 1, str(path))  # (ids start at 1)
        try:
            self.llm.llm_engine.add_lora(request)  # loaded and checked now, not at the next generation
        except (ValueError, RuntimeError, KeyError) as e:
            raise ValueError(f"vLLM does not take the learner's LoRA adapters ({type(e).__name__}: {e})") from None
        previous, self.request = self.request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)


class VLLMModel:
    """vLLM's model in this process (rltrain's engine's, or a server's worker's), as weights are loaded
    into it: ``sync=vllm``'s slots, or a ``sync=vllm_transfer`` gloo push."""

    def __init__(self, model, model_config, reset_prefix_cache: Callable[[], bool] | None = None):
        """``model`` and ``model_config``: vLLM's (its worker's model runner's); ``reset_prefix_cache``:
        vLLM's, called after each load (None: the caller resets it, as a server's client does over HTTP)."""
        self.model, self.model_config, self.reset_prefix_cache = model, model_config, reset_prefix_cache
        self.expected = {name for name, _ in self.model.named_parameters()}
        quiet_reloads()
        self.checkpoint = checkpoint_names(model_config.model, model_config.hf_config)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Load weights named as in the Hugging Face checkpoint (vLLM fuses and repacks them as it loads
        its own); raises ValueError naming what does not fit: a weight vLLM's model does not have, a
        shape it refuses, a weight of its own that nothing loaded.

        This is vLLM's in-place reload (``reload_weights``), plus two things it leaves stale: on the
        CPU an embedding keeps a packed copy of its weights for the output layer's GEMM, which the
        reload does not repack (the output layer would go on with the old weights: measured), and
        the prefix cache holds keys and values computed with the old weights."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if unlike := names_unlike(self.checkpoint, set(weights)):
            # vLLM's own check is per fused weight: a learner without k_proj still "loads" qkv_proj
            raise ValueError(f"the learner's weights are not the served model's: {unlike}")
        current = [None]

        def named():
            for name, tensor in weights.items():
                current[0] = name
                yield name, tensor

        initialize_layerwise_reload(self.model)
        try:
            loaded = self.model.load_weights(named())
        except (KeyError, AssertionError, RuntimeError, ValueError) as e:
            raise ValueError(f"vLLM's {type(self.model).__name__} cannot load the learner's {current[0]} "
                             f"{tuple(weights[current[0]].shape)} ({type(e).__name__}: {e})") from None
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        for module in self.model.modules():
            if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)
        if self.reset_prefix_cache is not None and not self.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update (cached keys and values "
                               "of the old weights would be reused)")
        if missing := sorted(self.expected - set(loaded)):
            raise ValueError(f"the learner's weights leave vLLM's {', '.join(missing)} unloaded (the learner's model "
                             "has other names than the engine's)")

    def load_slot(self, slot, version: int) -> None:
        """Load a ``sync=vllm`` slot (a FlatBuffer of the served weights), weights ``version``."""
        self.load(slot.views)


# The lines vLLM logs at every in-place reload (its loggers and format strings), and what this process shows
# once instead: the layers without weights of their own in a checkpoint "fail to load" at each push (those
# that do have weights and are not loaded fail VLLMModel.load), and the prefix cache is reset after each.
RELOAD_LINES = {
    "vllm.model_executor.model_loader.reload.layerwise": {
        "%s: Failed to load weights": "%s: no weights reloaded into it, as expected of a layer with none of its own "
                                      "in a checkpoint (rotary tables; an output layer tied to the embedding); any "
                                      "other weight left unloaded fails the load, named. Shown once, not at every push",
    },
    "vllm.v1.core.block_pool": {
        "Successfully reset prefix cache": "Successfully reset prefix cache (rltrain resets it after each weight "
                                           "update; shown once, not at every push)",
    },
}


class _OnceInstead(logging.Filter):
    """Shows each of ``lines``' records once (per message and arguments), as the INFO line given for it."""

    def __init__(self, lines: dict[str, str]):
        super().__init__()
        self.lines, self.shown = lines, set()

    def filter(self, record: logging.LogRecord) -> bool:
        instead = self.lines.get(record.msg)
        if instead is None:
            return True
        key = (record.msg, record.args)
        if key in self.shown:
            return False
        self.shown.add(key)
        record.msg, record.levelno, record.levelname = instead, logging.INFO, "INFO"
        return True


def quiet_reloads() -> None:
    """In a process where vLLM reloads weights in place (rltrain's engine, a server's worker): each of
    ``RELOAD_LINES`` once, not at every push. Idempotent."""
    for name, lines in RELOAD_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OnceInstead) for f in logger.filters):
            logger.addFilter(_OnceInstead(lines))


def names_unlike(expected: set[str] | None, given: set[str]) -> str:
    """What differs between the served model's weight names (``checkpoint_names``; None: unknown) and the
    learner's: "" if nothing."""
    if expected is None or given == expected:
        return ""
    missing, extra = sorted(expected - given), sorted(given - expected)
    return "; ".join(f"{what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                     for what, names in (("missing", missing), ("not in the served model", extra)) if names)


def checkpoint_names(source: str, hf_config=None) -> set[str] | None:
    """The weight names in a local model dir's safetensors files (None for a hub id or another format),
    less the output layer's copy some checkpoints keep of a tied embedding (the learner names it once)."""
    files = sorted(Path(source).glob("*.safetensors")) if Path(source).is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    names = set()
    for file in files:
        with safe_open(file, "pt") as f:
            names.update(f.keys())
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(source)
    if getattr(hf_config, "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return names


