"""``engine=vllm`` with ``device=cuda``: rltrain's engine on a GPU, fed by ``sync=vllm`` and each
``sync=vllm_transfer`` backend that runs there (``nccl`` needs a second GPU). Runs only where torch sees a
GPU and vLLM's GPU build is installed; the CPU tests (``test_vllm.py``) cover the same calls with the slots
and ``gloo``."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from rltrain.llm.engine import Sampling
from rltrain.llm.model import LanguageModel
from rltrain.llm.tiny import write_tiny_model
from tests.test_vllm import PROMPTS, _force, _learner_probe, connected, scheme_of

if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
    pytest.skip("needs a GPU and vLLM's GPU build (pip install vllm)", allow_module_level=True)

TRANSPORTS = ["shared_mem", "ipc"] + (["nccl"] if torch.cuda.device_count() > 1 else [])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pushes_reach_a_gpu_engine_checked_where_they_land(tmp_path, transport):
    from rltrain.llm.vllm.engine import VLLMEngine

    model = LanguageModel(str(write_tiny_model(tmp_path / "tiny")))
    learner = model.load().to("cuda:0")
    scheme = scheme_of(transport)
    sender = scheme.sender(learner)
    engine = connected(scheme, sender, VLLMEngine(model, scheme.receiver(), device="cuda:0", timeout_s=300,
                                                  gpu=1 if transport == "nccl" else 0, gpu_memory=0.3))
    tokenizer = model.tokenizer()
    ids = tokenizer("reverse 123: 321", add_special_tokens=False)["input_ids"]
    original = {k: v.clone() for k, v in learner.state_dict().items()}
    try:
        before = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=6, greedy=True))
        _force(learner, tokenizer.convert_tokens_to_ids("7"))
        version = sender.push()
        assert engine.sync() == version
        logprobs, held = engine.probe(ids)
        assert held == version
        assert torch.allclose(logprobs, _learner_probe(model, copy.deepcopy(learner).cpu(), ids), atol=1e-3)
        forced = engine.generate(PROMPTS, 2, Sampling(max_new_tokens=5, greedy=True))
        assert forced.version == version and forced.texts == ["77777"] * 6
        learner.load_state_dict(original)
        sender.push()
        after = engine.generate(PROMPTS, 1, Sampling(max_new_tokens=6, greedy=True))
        assert after.completion_ids.equal(before.completion_ids)
    finally:
        engine.close()
        sender.close()
