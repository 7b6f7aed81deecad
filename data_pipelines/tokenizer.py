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
--out must not exist unless --overwrite is given (then it is replaced once the new tokenizer is built). Inputs
holding no text are an error. Errors are one line (--debug, or TITANLOOP_DEBUG=1, shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from data_pipelines.cli import InputError, add_debug_flag, check_new_file, errors_as_one_line
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
        sp.add_argument("--out", required=True, help="tokenizer.json to write (must not exist, see --overwrite)")
        sp.add_argument("--overwrite", action="store_true", help="replace an existing --out")
        add_debug_flag(sp)
    args = p.parse_args(argv)
    try:
        check_new_file(args.out, "--out", args.overwrite)
    except InputError as e:
        p.error(str(e))
    if args.kind != "gpt2":
        try:
            args.text_split = TextSplit.parse(args.doc_split)
        except ValueError as e:
            p.error(str(e))
    if args.kind == "bpe" and args.vocab_size < 258:
        p.error(f"--vocab-size {args.vocab_size} is too small: a byte-level BPE needs >= 258 (256 bytes, EOS, a merge)")
    if args.kind == "bpe" and args.vocab_size >= 2**32:
        p.error(f"--vocab-size {args.vocab_size} is too large: expected < 2**32")
    if args.kind == "bpe" and not 0 <= args.min_frequency < 2**32:
        p.error(f"--min-frequency {args.min_frequency} is invalid: expected an integer >= 0 (default 2)")
    if args.kind == "gpt2":
        for name in ("encoder", "vocab_bpe"):
            if not os.path.isfile(getattr(args, name)):
                p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not a file")
    return args


def _texts(args):
    """The documents' texts, streamed (data_pipelines.readers)."""
    from data_pipelines.readers import read_documents

    inputs = args.input_files
    for path in inputs:
        for text, _, _ in read_documents(path, args.text_column, args.text_split):
            if text:  # a null text is no text
                args.chars_read += len(text)
                yield text


def _check_inputs(args) -> None:
    """List the inputs before any is read: a missing one or none at all is an error now, not after reading."""
    from data_pipelines.readers import list_inputs

    args.chars_read = 0
    if args.kind == "gpt2":
        return
    args.input_files = list_inputs(args.inputs)
    if not args.input_files:
        raise InputError(f"no parquet / jsonl(.zst) / txt files found in {args.inputs}")


def _no_text(args) -> InputError:
    return InputError(f"the inputs {args.inputs} hold no text: a tokenizer needs a corpus with at least one character")


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
    if args.chars_read == 0:
        raise _no_text(args)
    return tok


def build_char(args):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    chars: set[str] = set()
    for text in _texts(args):
        chars.update(text)
    if not chars:
        raise _no_text(args)
    vocab = {ch: i for i, ch in enumerate(sorted(chars))}
    vocab[EOS], vocab[UNK] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character a piece
    tok.decoder = decoders.Fuse()  # ids back to the characters, nothing between them
    tok.add_special_tokens([AddedToken(EOS, special=True, normalized=False), AddedToken(UNK, special=True)])
    return tok


def build_gpt2(args):
    from tokenizers import models

    expected = "expected GPT-2's encoder.json (token -> id)"
    try:
        with open(args.encoder, encoding="utf-8") as f:
            encoder = json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"--encoder {args.encoder} is not JSON ({e.msg}); {expected}") from None
    except UnicodeDecodeError:
        raise InputError(f"--encoder {args.encoder} is not UTF-8 text; {expected}") from None
    if not isinstance(encoder, dict) or EOS not in encoder:
        raise InputError(f"--encoder {args.encoder} has no {EOS}: {expected}")
    if not all(isinstance(i, int) for i in encoder.values()):
        raise InputError(f"--encoder {args.encoder} maps tokens to non-integers: {expected}")
    try:
        model = models.BPE.from_file(args.encoder, args.vocab_bpe)
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception types for a bad merges file
        raise InputError(f"--vocab-bpe {args.vocab_bpe}: {e}; expected GPT-2's vocab.bpe") from None
    return byte_level(model)


def main(argv=None) -> None:
    args = parse_args(argv)
    with errors_as_one_line(args.debug):
        run(args)


def run(args: argparse.Namespace) -> None:
    _check_inputs(args)
    build = {"bpe": build_bpe, "char": build_char, "gpt2": build_gpt2}[args.kind]
    tok = build(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = f"{args.out}.tmp-{os.getpid()}"
    try:
        tok.save(tmp)
        os.replace(tmp, args.out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)

    from titanloop.data.tokenizer import tokenizer_record

    record = tokenizer_record(args.out, EOS)
    print(
        f"wrote {args.out}: {args.kind}, {record['vocab_size']} tokens, eos {EOS} = {record['eos_id']}, "
        f"{record['fingerprint'][:17]}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
