"""Write a synthetic reasoning task as training and held-out shard sets (same formats as the corpora).

    python -m data_pipelines.synthetic --task mano --out /data/shards/mano --format mds \
        --train-docs 200000 --eval-examples 2000 --option max_ops=10

Creates <out>/train (documents: prompt + answer + EOS, `prompt_len` marks the non-target prompt) and
<out>/eval (held-out examples, disjoint from every training prompt by construction). The manifest's
tokenizer fingerprint is the task vocabulary's (task:<sha1>), so a loader configured for another task or
tokenizer refuses the set. Tasks and options: see titanloop/data/synthetic_tasks.py. <out>/train and <out>/eval
must be new or empty (--overwrite replaces shard sets there); both are checked before anything is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from data_pipelines.cli import InputError, add_debug_flag, errors_as_one_line


def parse_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise InputError(f"--option {text!r} is invalid: expected key=value, e.g. max_ops=16")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m data_pipelines.synthetic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", required=True, choices=["mano", "addition", "xor", "multihop"])
    p.add_argument("--out", required=True, help="new directory (or URL); train/ and eval/ are created inside")
    p.add_argument("--format", choices=["mds", "webdataset"], default="mds")
    p.add_argument("--train-docs", type=int, default=100_000, help="training documents (default: 100000)")
    p.add_argument("--eval-examples", type=int, default=1000, help="held-out examples (default: 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task option, repeatable (mano: max_ops, modulus; addition: n_digits; "
        "xor: n_bits, eval_n_bits; multihop: fact_fraction, n_eval, world_seed, ...)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace shard sets already in <out>/train, <out>/eval")
    add_debug_flag(p)
    a = p.parse_args(argv)
    if a.train_docs < 1 or a.eval_examples < 1:
        p.error("--train-docs and --eval-examples must be >= 1")
    with errors_as_one_line(a.debug):
        run(a)


def run(a: argparse.Namespace) -> None:
    import numpy as np
    from tqdm import tqdm

    from titanloop.config_errors import ConfigError
    from titanloop.data.synthetic_tasks import EOS, build_task, eval_examples
    from titanloop.data.shard_output import OutputDir, write_shard_set

    base = a.out.rstrip("/")
    targets = {s: OutputDir(f"{base}/{s}", a.overwrite, f"--out ({s}/)", prepare=False) for s in ("train", "eval")}
    try:
        task = build_task(a.task, seed=a.seed, **dict(parse_option(o) for o in a.option))
    except ConfigError as e:
        raise InputError(str(e)) from None
    tokenizer = {
        "fingerprint": task.fingerprint(),
        "vocab_size": task.vocab_size,
        "eos_id": EOS,
        "path": f"task:{a.task}",
        "vocab": task.vocab,
    }
    start, counted = time.time(), {"tokens": 0}

    def train_docs():
        bar = tqdm(total=a.train_docs, unit="doc", desc=f"{a.task} train", file=sys.stderr, mininterval=0.5)
        for j in range(a.train_docs):
            doc, n_prompt = task.training_document(np.random.default_rng([a.seed, 1, j]))
            counted["tokens"] += len(doc)
            bar.update(1)
            bar.set_postfix_str(f"{counted['tokens'] / max(time.time() - start, 1e-9):,.0f} tok/s", refresh=False)
            yield doc, f"{a.task}-train-{j}", n_prompt, {}
        bar.close()

    def eval_docs():
        for j, (prompt, answer) in enumerate(eval_examples(task, a.eval_examples, a.seed)):
            yield prompt + answer + [EOS], f"{a.task}-eval-{j}", len(prompt), {}

    for t in targets.values():
        t.prepare()
    try:
        train = write_shard_set(
            f"{base}/train", a.format, f"{a.task}-train", train_docs(), tokenizer, target=targets["train"]
        )
        held = write_shard_set(
            f"{base}/eval", a.format, f"{a.task}-eval", eval_docs(), tokenizer, target=targets["eval"]
        )
    except BaseException:
        for t in targets.values():
            t.discard()
        raise
    print(
        f"wrote {a.task}: train {train.documents} documents / {train.tokens} tokens, eval {held.documents} "
        f"examples / {held.tokens} tokens -> {base} ({time.time() - start:.1f}s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
