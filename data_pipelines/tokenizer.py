"""Build a Hugging Face `tokenizer.json` for titanloop: train a byte-level BPE, build a character-level tokenizer,
or convert GPT-2's published vocabulary.

    python -m data_pipelines.tokenizer bpe --vocab-size 4096 --out bpe4k.json  corpus/          # byte-level BPE
    python -m data_pipelines.tokenizer char --out char.json  input.txt                           # one id per char
    python -m data_pipelines.tokenizer gpt2 --encoder encoder.json --vocab-bpe vocab.bpe --out gpt2.json

Every tokenizer it writes is a plain `tokenizers` file that the whole stack reads by path: `data_pipelines.tokenize`
(shards), training and validation (`[data] tokenizer` checks the shards' fingerprint), `titanloop.eval generate
--prompt`, the lm-eval adapter and the Hugging Face export (`python -m titanloop.interchange export --checkpoint`).
Each has an end-of-text token, `<|endoftext|>`, which `data_pipelines.tokenize` appends to every document.

  bpe   GPT-2-style byte-level BPE (the same pre-tokenizer regex and byte alphabet) trained with `tokenizers`'
        BpeTrainer on the input documents to --vocab-size tokens (the 256 bytes and <|endoftext|> included):
        every string encodes, none maps to an unknown token.
  char  one id per character of the inputs, in code-point order (what nanoGPT's shakespeare_char example
        builds: its 65 characters get ids 0..64), then <|endoftext|> and <unk> (for characters the inputs lack).
  gpt2  GPT-2's byte-level BPE from its `encoder.json` (50,257 tokens) and `vocab.bpe` (50,000 merges), with
        <|endoftext|> (id 50256) special; it encodes as OpenAI's GPT-2 encoder does.

Inputs are read as `data_pipelines.tokenize` reads them (parquet, JSON lines with a `text` field, .txt; streamed).
--out must not exist: nothing is overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from data_pipelines.readers import TextSplit

EOS = "<|endoftext|>"
UNK = "<unk>"


def _inputs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="parquet / .jsonl / .jsonl.zst(d) / .txt files or directories")
    p.add_argument("--text-column", default="text", help="column / key holding the document text (default: text)")
    p.add_argument(
        "--doc-split",
        default="file",
        help="plain text: file | paragraph | line | start=REGEX (as data_pipelines.tokenize; default file)",
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m data_pipelines.tokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="kind", required=True)
    b = sub.add_parser("bpe", help="train a byte-level BPE on a corpus", description="Train a byte-level BPE.")
    _inputs_args(b)
    b.add_argument("--vocab-size", type=int, required=True, help="tokens in all (>= 258: 256 bytes, EOS, 1 merge)")
    b.add_argument("--min-frequency", type=int, default=2, help="a merge's pair must occur this often (default 2)")
    c = sub.add_parser("char", help="one token per character of a corpus", description="Build a character tokenizer.")
    _inputs_args(c)
    g = sub.add_parser("gpt2", help="GPT-2's vocabulary as a tokenizer.json", description="Convert GPT-2's files.")
    g.add_argument("--encoder", required=True, help="GPT-2's encoder.json (token -> id, 50,257 entries)")
    g.add_argument("--vocab-bpe", required=True, help="GPT-2's vocab.bpe (the merges)")
    for sp in (b, c, g):
        sp.add_argument("--out", required=True, help="tokenizer.json to write (must not exist)")
    args = p.parse_args(argv)
    if os.path.exists(args.out):
        p.error(f"--out {args.out} exists: choose a new path (an existing tokenizer is never overwritten)")
    if args.kind != "gpt2":
        try:
            args.text_split = TextSplit.parse(args.doc_split)
        except ValueError as e:
            p.error(str(e))
    if args.kind == "bpe" and args.vocab_size < 258:
        p.error(f"--vocab-size {args.vocab_size} is too small: a byte-level BPE needs >= 258 (256 bytes, EOS, a merge)")
    if args.kind == "gpt2":
        for name in ("encoder", "vocab_bpe"):
            if not os.path.isfile(getattr(args, name)):
                p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not a file")
    return args


def _texts(args):
    """The documents' texts, streamed (data_pipelines.readers)."""
    from data_pipelines.readers import list_inputs, read_documents

    inputs = list_inputs(args.inputs)
    if not inputs:
        raise SystemExit(f"error: no parquet / jsonl(.zst) / txt files found in {args.inputs}")
    for path in inputs:
        for text, _, _ in read_documents(path, args.text_column, args.text_split):
            yield text


def byte_level(model):
    """A GPT-2-style byte-level tokenizer around `model` (a BPE): GPT-2's pre-tokenizer regex, byte alphabet and
    decoder, with EOS special."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    return tok


def build_bpe(args):
    from tokenizers import models, pre_tokenizers, trainers

    tok = byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(_texts(args), trainer=trainer)
    return tok


def build_char(args):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    chars: set[str] = set()
    for text in _texts(args):
        chars.update(text)
    if not chars:
        raise SystemExit(f"error: the inputs {args.inputs} hold no text")
    vocab = {ch: i for i, ch in enumerate(sorted(chars))}
    vocab[EOS], vocab[UNK] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character a piece
    tok.decoder = decoders.Fuse()  # ids back to the characters, nothing between them
    tok.add_special_tokens([AddedToken(EOS, special=True, normalized=False), AddedToken(UNK, special=True)])
    return tok


def build_gpt2(args):
    from tokenizers import models

    try:
        with open(args.encoder, encoding="utf-8") as f:
            encoder = json.load(f)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: --encoder {args.encoder} is not JSON ({e.msg}); expected GPT-2's encoder.json")
    if EOS not in encoder:
        raise SystemExit(f"error: --encoder {args.encoder} has no {EOS}: expected GPT-2's encoder.json")
    try:
        model = models.BPE.from_file(args.encoder, args.vocab_bpe)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception types for a bad merges file
        raise SystemExit(f"error: --vocab-bpe {args.vocab_bpe}: {e}; expected GPT-2's vocab.bpe") from None
    return byte_level(model)


def main(argv=None) -> None:
    args = parse_args(argv)
    build = {"bpe": build_bpe, "char": build_char, "gpt2": build_gpt2}[args.kind]
    tok = build(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    tok.save(tmp)
    os.replace(tmp, args.out)

    from titanloop.data.tokenizer import tokenizer_record

    record = tokenizer_record(args.out, EOS)
    print(
        f"wrote {args.out}: {args.kind}, {record['vocab_size']} tokens, eos {EOS} = {record['eos_id']}, "
        f"{record['fingerprint'][:17]}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
