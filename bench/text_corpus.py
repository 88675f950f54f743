"""A corpus of real English text and a byte-level BPE tokenizer for it, built offline and cached.

The benchmarks that need a task a model is still learning at the end of a run (not the
tiny default's arithmetic, which it learns to its floor) train on this. Its text is the
docstrings of Python's standard library and of ``transformers`` (a dependency): English
prose about programs, present on every machine that runs this project, so the corpus is
the same wherever the interpreter and ``transformers`` are the same versions. Each docstring of
at least ``MIN_CHARS`` characters is one JSONL row ``{"text": ...}``; the tokenizer is a
byte-level BPE of ``VOCAB`` tokens trained on those rows (Hugging Face ``tokenizers``),
saved as a ``PreTrainedTokenizerFast`` folder a config can name in ``tokenizer_name``.

``build(cache)`` returns ``(jsonl_path, tokenizer_dir)``, building them once per cache
folder (default ``~/.cache/diloco-ray/bench-text``); ``python bench/text_corpus.py``
builds and prints their sizes.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import re
import sys
import sysconfig

VOCAB = 2048
MIN_CHARS = 200
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "diloco-ray", "bench-text")
PACKAGES = ("transformers",)  # installed packages whose docstrings join the standard library's
SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}


def sources() -> list[str]:
    """The ``.py`` files read, in a fixed order: the standard library (without its tests)
    and :data:`PACKAGES`."""
    roots = [sysconfig.get_paths()["stdlib"]]
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(spec.submodule_search_locations)
    files = []
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in SKIP)
            files.extend(os.path.join(folder, n) for n in sorted(names) if n.endswith(".py"))
    return files


def docstrings() -> list[str]:
    """Every docstring of :func:`sources` (modules, classes, functions), read with ``ast``
    (nothing is imported), whitespace normalised, without repeats."""
    seen, out = set(), []
    for path in sources():
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in nodes:
            text = re.sub(r"\s+", " ", ast.get_docstring(node) or "").strip()
            if len(text) >= MIN_CHARS and text not in seen:
                seen.add(text)
                out.append(text)
    return out


def build(cache: str = DEFAULT_CACHE) -> tuple[str, str]:
    """The corpus and its tokenizer under ``cache`` (one folder per Python minor version
    and ``transformers`` version), built on first use."""
    import transformers

    version = f"py{sys.version_info.major}.{sys.version_info.minor}-transformers{transformers.__version__}"
    folder = os.path.join(cache, version)
    data, tok = os.path.join(folder, "text.jsonl"), os.path.join(folder, f"bpe{VOCAB}")
    if os.path.exists(os.path.join(tok, "tokenizer.json")) and os.path.exists(data):
        return data, tok
    os.makedirs(folder, exist_ok=True)
    texts = docstrings()
    with open(data + ".tmp", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    os.replace(data + ".tmp", data)
    _train_tokenizer(texts, tok)
    return data, tok


def identity(data: str, tokenizer: str) -> str:
    """What names the task a corpus makes: its folder (Python and ``transformers`` versions)
    and the first 12 hex digits of the SHA-256 of its rows and its tokenizer. Runs on
    different identities trained on different tokens and are not compared (a new
    ``transformers`` changes its docstrings, a new ``tokenizers`` may merge them otherwise)."""
    digest = hashlib.sha256()
    for path in (data, os.path.join(tokenizer, "tokenizer.json")):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return f"{os.path.basename(os.path.dirname(data))}:{digest.hexdigest()[:12]}"


def _train_tokenizer(texts: list[str], folder: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(folder)


if __name__ == "__main__":
    path, tokenizer = build()
    rows = sum(1 for _ in open(path))
    print(f"{path}: {rows} texts, {os.path.getsize(path) / 1e6:.2f} MB; tokenizer {tokenizer}")
