"""Language models as policies: verifiable tasks (prompts, reference answers, reward functions) and
the tiny causal LM that tests and the built-in examples train without downloading anything.

Generation as a collector (an engine interface: transformers in-process, then vLLM) and ``algo=grpo``
build on these parts. Needs the ``llm`` extra (transformers, with tokenizers).
"""

from rltrain.llm.model import LanguageModel  # noqa: E402

__all__ = ["LanguageModel"]
