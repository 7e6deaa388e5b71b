"""A tiny causal LM made here, from a config with random weights, and a character-level tokenizer
trained by nothing (its vocabulary is the characters the built-in tasks use): a Hugging Face model
dir that ``AutoModelForCausalLM``/``AutoTokenizer`` load, with nothing downloaded.

    python -m rltrain.llm.tiny outputs/tiny-qwen2            # writes the dir (or any path)
    python -m rltrain.llm.tiny outputs/tiny-llama --arch llama

``tiny_model_dir(name)`` makes one on first use in ``$RLTRAIN_CACHE`` (default ``~/.cache/rltrain``)
and returns it afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import string
import tempfile
from pathlib import Path

ARCHS = ("qwen2", "llama")
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Every character a built-in task writes or a completion may need: digits, operators, letters, punctuation.
CHARACTERS = string.digits + string.ascii_letters + " +-*/=?:,.()<>[]'\"!\n"
_PRINTABLE = {*range(33, 127), *range(161, 173), *range(174, 256)}  # bytes that are their own symbol
_SHIFTED = [b for b in range(256) if b not in _PRINTABLE]
_MADE = "rltrain_tiny.json"  # written last: a dir without it was cut short and is made again
_FORMAT = 2  # in _MADE; a cached dir of another format is made again (1: 16-wide heads, which vLLM's CPU build refuses)


def make_tokenizer(characters: str = CHARACTERS):
    """A character-level fast tokenizer: one token per character of ``characters``, with pad, bos,
    eos and unk tokens; ``decode`` gives the text back exactly. Byte-level BPE without merges (each
    character its byte-level symbol: a space is ``Ġ``), the form of Qwen2's and Llama 3's tokenizers,
    so that transformers' own tokenizer classes for those models read it as it is written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIALS, *(_byte_level(c) for c in characters)])}
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def _byte_level(char: str) -> str:
    """The byte-level BPE symbol of an ASCII character (GPT-2's mapping: printable characters are
    themselves, the others are shifted past 255: a space is ``Ġ``, a newline ``Ċ``)."""
    code = ord(char)
    return char if code in _PRINTABLE else chr(256 + _SHIFTED.index(code))


def make_model(vocab_size: int, arch: str = "qwen2", hidden_size: int = 64, layers: int = 2,
               heads: int | None = None, kv_heads: int | None = None, context: int = 256, seed: int = 0,
               pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2):
    """A randomly initialised causal LM of ``arch`` (Qwen2 or Llama: the architectures vLLM serves too).
    Heads are 32 wide unless ``heads`` says otherwise (vLLM's CPU attention takes 32, 64, 80, ... but not 16),
    with half as many key/value heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)} (got {arch!r})")
    heads = heads or max(1, hidden_size // 32)
    kv_heads = kv_heads or max(1, heads // 2)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        max_position_embeddings=context, tie_word_embeddings=True, pad_token_id=pad_token_id,
                        bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    torch.manual_seed(seed)
    return model_cls(config)


def write_tiny_model(path: str | Path, arch: str = "qwen2", seed: int = 0, **sizes) -> Path:
    """Write a tiny model dir at ``path`` (weights, config, tokenizer); written to a temporary dir
    beside it and renamed, so a dir at ``path`` is always whole."""
    path = Path(path)
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer), arch, seed=seed, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **sizes)
    with stage_model_dir(path, {"arch": arch, "seed": seed, **sizes}) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return path


@contextlib.contextmanager
def stage_model_dir(path: str | Path, made: dict):
    """A temporary dir beside ``path`` to write a model dir into; once the block ends, it is marked whole
    (``made``, with this format) and renamed to ``path``. A block that raises leaves nothing behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield staging
        (staging / _MADE).write_text(json.dumps({"format": _FORMAT, **made}) + "\n")
        staging.chmod(0o755)  # mkdtemp makes it private
        staging.replace(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def cached_model_dir(name: str, write) -> Path:
    """The model dir ``name`` in rltrain's cache (``$RLTRAIN_CACHE/models``), made by ``write(path)`` on first use."""
    path = Path(os.environ.get("RLTRAIN_CACHE", Path.home() / ".cache" / "rltrain")) / "models" / name
    if not _made(path):
        if path.exists():  # cut short by a crash, or of an older format: make it again
            shutil.rmtree(path)
        try:
            write(path)
        except OSError:
            if not _made(path):  # not another process that made it first
                raise
    return path


def tiny_model_dir(name: str = "tiny-qwen2", arch: str = "qwen2", seed: int = 0) -> Path:
    """The dir of the tiny model ``name`` in rltrain's cache, made on first use."""
    return cached_model_dir(name, lambda path: write_tiny_model(path, arch, seed))


def _made(path: Path) -> bool:
    """Whether ``path`` holds a whole tiny model dir of this format."""
    try:
        return json.loads((path / _MADE).read_text()).get("format") == _FORMAT
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rltrain.llm.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="the model dir to write (it must not exist)")
    parser.add_argument("--arch", choices=ARCHS, default="qwen2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    if Path(args.path).exists():
        parser.error(f"{args.path} exists; give a new path")
    path = write_tiny_model(args.path, args.arch, args.seed, hidden_size=args.hidden_size, layers=args.layers)
    print(path)


if __name__ == "__main__":
    main()
