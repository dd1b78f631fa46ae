"""A small byte-level BPE tokenizer trained in well under a second, for serving tests."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles",
    "naïve café déjà vu — ünïcödé 日本語のテキスト 🙂 emoji",
] * 20


def build_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) with `<eos>` as the only special token (id 0)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def save_tokenizer(directory: Path, vocab_size: int = 320) -> Path:
    """Write `directory/tokenizer.json` and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    build_tokenizer(vocab_size).save(str(path))
    return path
