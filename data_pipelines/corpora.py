"""Build the tokenizer and shard sets of a corpus committed in this repository (data/README.md), in one command.

    python -m data_pipelines.corpora shakespeare_char      # -> data/shards/shakespeare_char/{tokenizer.json,train,val}
    python -m data_pipelines.corpora --list

It runs the two public commands a user runs on their own corpus, `data_pipelines.tokenizer` and
`data_pipelines.tokenize` (printing each), so what it builds is what they build. A corpus already built with the
same tokenizer is left as it is; a partly built one is an error naming the directory to remove, and --overwrite
builds it again from scratch. A build that fails removes what it wrote.

    shakespeare_char   tinyshakespeare, one id per character (67: 65 characters, EOS, <unk>), split as nanoGPT's
                       shakespeare_char: the first 90% of the characters train, the last 10% held out
    shakespeare_gpt2   the same split with GPT-2's BPE (50,257 tokens; nanoGPT's `shakespeare` example)
    wikitext2_char     WikiText-2's test split trains, its valid split is held out; one id per character of
                       both; documents are the articles (a line ` = Title = ` starts one)
    wikitext2_bpe      the same split with a byte-level BPE of 2,048 tokens trained on the training text
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from data_pipelines.cli import InputError, add_debug_flag, check_output_dir, errors_as_one_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data")
WIKITEXT_ARTICLE = "start=^ = [^=].* = $"

# name -> (tokenizer command arguments, tokenizer inputs, training inputs, held-out rule, --doc-split)
# held-out rule: a fraction of the training inputs' characters, or the held-out inputs' paths
CORPORA = {
    "shakespeare_char": (["char"], ["tinyshakespeare.txt"], ["tinyshakespeare.txt"], 0.1, "file"),
    "shakespeare_gpt2": (
        ["gpt2", "--encoder", "gpt2/encoder.json", "--vocab-bpe", "gpt2/vocab.bpe"],
        [],
        ["tinyshakespeare.txt"],
        0.1,
        "file",
    ),
    "wikitext2_char": (
        ["char"],
        ["wikitext-2/test.txt", "wikitext-2/valid.txt"],
        ["wikitext-2/test.txt"],
        ["wikitext-2/valid.txt"],
        WIKITEXT_ARTICLE,
    ),
    "wikitext2_bpe": (
        ["bpe", "--vocab-size", "2048"],
        ["wikitext-2/test.txt"],
        ["wikitext-2/test.txt"],
        ["wikitext-2/valid.txt"],
        WIKITEXT_ARTICLE,
    ),
}


def paths(name: str, out_root: str) -> dict:
    out = os.path.join(out_root, name)
    return {
        "dir": out,
        "tokenizer": os.path.join(out, "tokenizer.json"),
        "train": os.path.join(out, "train"),
        "val": os.path.join(out, "val"),
    }


def _run(module, argv: list[str]) -> None:
    shown = " ".join(a if " " not in a and "$" not in a else repr(a) for a in argv)
    print(f"[corpora] python -m {module.__name__} {shown}", file=sys.stderr, flush=True)
    module.main(argv)


def build(name: str, out_root: str = os.path.join(DATA, "shards"), workers: int = 1, overwrite: bool = False) -> dict:
    """Build corpus `name` under out_root/name (module docstring); returns its paths. Idempotent; `overwrite`
    removes an earlier build (complete or not) first."""
    from data_pipelines import tokenize, tokenizer
    from titanloop.data.shard_format import MANIFEST

    if name not in CORPORA:
        raise SystemExit(f"error: corpus {name!r} is unknown: expected one of {', '.join(CORPORA)} (see --list)")
    try:
        check_output_dir(out_root, "--out")
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
    tok_args, tok_inputs, train, held, split = CORPORA[name]
    p = paths(name, out_root)
    if os.path.exists(p["dir"]) and not os.path.isdir(p["dir"]):
        raise SystemExit(f"error: {p['dir']} is a file: remove it or choose another --out")
    if os.path.isdir(p["dir"]) and overwrite:
        foreign = sorted(set(os.listdir(p["dir"])) - {"tokenizer.json", "train", "val"})
        if foreign:
            raise SystemExit(
                f"error: {p['dir']} holds {foreign[0]}, which a build does not write: --overwrite replaces only a "
                "build; move it away or choose another --out"
            )
        shutil.rmtree(p["dir"])
    done = [os.path.isfile(p["tokenizer"])] + [os.path.isfile(os.path.join(p[s], MANIFEST)) for s in ("train", "val")]
    if all(done):
        print(f"[corpora] {name}: already built in {p['dir']}", file=sys.stderr)
        return p
    if os.path.exists(p["dir"]):
        raise SystemExit(
            f"error: {p['dir']} is partly built (an earlier build stopped): remove it, or run again with --overwrite"
        )
    os.makedirs(p["dir"])
    try:
        rel = lambda files: [os.path.join(DATA, f) for f in files]  # noqa: E731
        tok_argv = [
            tok_args[0],
            *[os.path.join(DATA, a) if a.endswith((".json", ".bpe")) else a for a in tok_args[1:]],
        ]
        if tok_inputs:
            tok_argv += ["--doc-split", split, *rel(tok_inputs)]
        _run(tokenizer, [*tok_argv, "--out", p["tokenizer"]])
        common = ["--tokenizer", p["tokenizer"], "--doc-split", split, "--workers", str(workers)]
        if isinstance(held, float):
            _run(
                tokenize,
                [*common, "--out", p["train"], "--holdout", str(held), "--holdout-out", p["val"], *rel(train)],
            )
        else:
            _run(tokenize, [*common, "--out", p["train"], *rel(train)])
            _run(tokenize, [*common, "--out", p["val"], "--source", f"{name}-holdout", *rel(held)])
    except BaseException:
        shutil.rmtree(p["dir"], ignore_errors=True)  # a failed build is not left half done
        raise
    return p


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m data_pipelines.corpora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", help="corpora to build (see --list)")
    parser.add_argument("--out", default=os.path.join(DATA, "shards"), help="where (default: data/shards)")
    parser.add_argument("--list", action="store_true", help="list the corpora and exit")
    parser.add_argument("--overwrite", action="store_true", help="build again a corpus already (partly) built")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.list or not args.names:
        for name in CORPORA:
            print(name)
        return
    unknown = [n for n in args.names if n not in CORPORA]
    if unknown:
        parser.error(f"corpus {unknown[0]!r} is unknown: expected one of {', '.join(CORPORA)} (see --list)")
    with errors_as_one_line(args.debug):
        for name in args.names:
            build(name, args.out, overwrite=args.overwrite)


if __name__ == "__main__":
    main()
