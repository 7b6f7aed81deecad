"""Hugging Face `tokenizer.json` loading, fingerprints and EOS detection.

The fingerprint is the sha1 of the tokenizer's canonical JSON (keys sorted, whitespace-free), so two files
that tokenize identically but differ in formatting agree, and any change to vocab, merges, normalizer or
pre-tokenizer changes it. Shard manifests record it; the loader refuses shards whose fingerprint differs.
"""

from __future__ import annotations

import hashlib
import json
import os

from titanloop.config_errors import ConfigError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


def tokenizer_fingerprint(path: str) -> str:
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer={path!r} is invalid: expected the path of a Hugging Face tokenizer.json file")
    with open(path, encoding="utf-8") as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"tokenizer={path!r} is not valid JSON ({e.msg} at line {e.lineno})") from None
        except UnicodeDecodeError:
            raise ConfigError(
                f"tokenizer={path!r} is not a text file (not UTF-8): expected a Hugging Face tokenizer.json"
            ) from None
    if not isinstance(obj, dict) or "model" not in obj:
        raise ConfigError(f"tokenizer={path!r} is JSON but not a tokenizer: expected a Hugging Face tokenizer.json")
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha1:" + hashlib.sha1(canonical.encode("utf-8")).hexdigest()


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    tokenizer_fingerprint(path)  # one-line error for a missing or broken file
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception for JSON that is not a tokenizer
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"tokenizer={path!r} is not a Hugging Face tokenizer.json ({reason}): expected a file written by "
            "data_pipelines.tokenizer or a model's tokenizer.json"
        ) from None


def find_eos_id(tokenizer, eos_token: str | None = None) -> int:
    """The id of `eos_token`, or of the first well-known end-of-text token the vocabulary has."""
    names = (eos_token,) if eos_token else EOS_CANDIDATES
    for name in names:
        i = tokenizer.token_to_id(name)
        if i is not None:
            return int(i)
    raise ConfigError(
        f"eos_token={eos_token!r} is invalid: expected a token of the tokenizer's vocabulary "
        f"(none of {list(names)} is in it); pass --eos-token"
    )


def tokenizer_record(path: str, eos_token: str | None = None) -> dict:
    """What a shard manifest records about its tokenizer: fingerprint, vocab_size, eos_id, absolute path."""
    fingerprint = tokenizer_fingerprint(path)
    tokenizer = load_tokenizer(path)
    return {
        "fingerprint": fingerprint,
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_id": find_eos_id(tokenizer, eos_token),
        "path": os.path.abspath(path),
    }
