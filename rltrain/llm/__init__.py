"""Language models as policies: the ``model`` node (``LanguageModel``), verifiable tasks (prompts,
reference answers, reward functions), the generation engine, and the tiny causal LM that tests and
the built-in examples train without downloading anything. ``collector=generation`` and
``algo=grpo`` use these parts. Needs the ``llm`` extra (transformers, with tokenizers); importing
this package does not import transformers.
"""

from rltrain.llm.model import LanguageModel

__all__ = ["LanguageModel"]
