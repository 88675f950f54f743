"""Tokenizers: the one a job names (``tokenizer_name``, else ``model_name``) or the
builtin character tokenizer, always with a pad and an eos token.

No torch here: the task that tokenises a job's data once for every rank (see
:func:`diloco_ray.data.samples.prepare_token_data`) imports this and nothing heavier.
"""

from __future__ import annotations

import string

from diloco_ray.config.sections import ModelSection
from diloco_ray.errors import ConfigError, first_line

BUILTIN_CHAR_TOKENIZER = "builtin:char"
_CHARS = list(string.printable[:95]) + ["\n", "\t"]


def char_tokenizer():
    """A character-level tokenizer over printable ASCII, built offline.

    Each character is one token; ``<pad>`` (0), ``<eos>`` (1) and ``<unk>`` (2) come first.
    It is a real ``PreTrainedTokenizerFast``, so it saves and reloads like any other.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + _CHARS)}
    # BPE with no merges splits text into single characters; Fuse joins them back.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def load_tokenizer(model: ModelSection):
    """The tokenizer named by ``tokenizer_name`` (default ``model_name``), with a pad token."""
    name = model.tokenizer_name or model.model_name or BUILTIN_CHAR_TOKENIZER
    if name == BUILTIN_CHAR_TOKENIZER:
        tok = char_tokenizer()
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:
            field = "tokenizer_name" if model.tokenizer_name else "model_name"
            raise ConfigError(
                f"{field}: cannot load a tokenizer from '{name}' "
                f"(not a local folder, and not reachable on the hub): {first_line(e)}"
            ) from None
    if tok.pad_token is None:
        # Causal LMs often ship without one; padding positions are masked out of the loss.
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if tok.eos_token is None:
        raise ConfigError(
            f"tokenizer_name: the tokenizer from '{name}' has no eos token, which packing needs to separate documents"
        )
    return tok
