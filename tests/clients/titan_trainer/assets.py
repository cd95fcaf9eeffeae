"""The files torchtitan's trainer reads, made small and offline: a BPE tokenizer and a JSON-lines text set.

torchtitan 0.3.0's wheel ships no ``tests/assets``.  :func:`make_assets` writes, into one folder:

- ``tokenizer/``: ``tokenizer.json`` (a byte-level BPE trained here with the ``tokenizers``
  library) and ``tokenizer_config.json`` naming its BOS and EOS tokens, what torchtitan's
  ``HuggingFaceTokenizer`` loads from ``--hf_assets_path``;
- ``c4_test/data.jsonl``: ``{"text": ...}`` lines, what the registered ``c4_test`` dataset
  (``datasets.load_dataset(path, split="train")``, ``sample["text"]``) reads from
  ``--dataloader.dataset_path``.

The text is made from a fixed word list by a seeded generator, so the same call writes the same
files.  The vocabulary stays within the debug model's 2048 embeddings.

Run as ``python tests/clients/titan_trainer/assets.py FOLDER``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

__all__ = ["BOS", "EOS", "make_assets"]

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

_WORDS = (
    "the a of to and in is it that for on with as was by at from this be are or an have not but "
    "model train step graph rank tensor shard gather reduce scatter bucket layer weight gradient "
    "loss token batch sequence attention norm linear embed output input mesh device process group "
    "compile pass node meta region forward backward memory save recompute overlap schedule"
).split()


def _lines(num_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        sentences = [
            " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 14))).capitalize() + "."
            for _ in range(rng.randint(2, 6))
        ]
        lines.append(" ".join(sentences))
    return lines


def make_assets(
    folder: str | Path, *, num_lines: int = 2000, vocab_size: int = 512, seed: int = 0
) -> tuple[Path, Path]:
    """Writes the tokenizer and the data set into ``folder``; returns (``--hf_assets_path``, ``--dataloader.dataset_path``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 0 < vocab_size <= 2048:
        raise ValueError(f"make_assets: vocab_size {vocab_size} does not fit the debug model's 2048 embeddings")
    folder = Path(folder)
    tokenizer_dir, data_dir = folder / "tokenizer", folder / "c4_test"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = _lines(num_lines, seed)
    with open(data_dir / "data.jsonl", "w") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in lines)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    with open(tokenizer_dir / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}, f, indent=1)
    return tokenizer_dir, data_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/clients/titan_trainer/assets.py FOLDER")
    for path in make_assets(sys.argv[1]):
        print(path)
