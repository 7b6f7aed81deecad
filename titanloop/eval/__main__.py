"""Command line: `python -m titanloop.eval {sweep,compare,generate} --help`.

python -m titanloop.eval sweep CKPT --data task:mano --out out/eval          # report.json + plots
python -m titanloop.eval sweep CKPT --data seqs.jsonl --loops 1,2,4,8 --q 0,0.5,0.9,1
python -m titanloop.eval generate CKPT --prompt-ids 5,17,3 --max-new-tokens 16 --cache-policy last
python -m titanloop.eval generate CKPT --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-k 20
python -m titanloop.eval sweep CKPT --data task:mano --device cpu --dtype float32    # force the CPU
python -m titanloop.eval compare eval_a eval_b runs/c --labels a,b,c --out cmp    # loss vs T, several runs

Both subcommands load the model straight onto --device in --dtype (default auto: CUDA in bfloat16 when
torch.cuda.is_available(), else the CPU in float32) and compute there.

Bad input answers with one line and a nonzero exit (--debug or TITANLOOP_DEBUG=1: the traceback), before the model
is loaded where it can: sweep refuses a non-empty --out unless --overwrite. A DCP checkpoint's files are checked
against its manifest (size, crc32) and a NaN or infinite weight is refused; shards (--data) and --tokenizer must
match the tokenizer the checkpoint names; --prompt characters the tokenizer lacks are an error (--allow-unknown:
a warning).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from titanloop.cli import DEBUG_ENV, check_output, debug_enabled, one_line_errors
from titanloop.config_errors import ConfigError

DATA_HELP = (
    "evaluation data: a shard-set directory (holding manifest.json, e.g. a held-out split written by "
    "data_pipelines.tokenize --holdout-out), scored whole: every window of --seq-len tokens once; a .jsonl file "
    "with one token sequence per line (a JSON list of ids, or an object with 'input_ids' and optional 'labels'); a "
    ".json file holding a titanloop.data DataConfig dict; 'task:NAME' for held-out examples of a synthetic task "
    "(mano, addition, xor, multihop); or 'synthetic_text'"
)
WHERE = (
    "The model is loaded straight onto --device in --dtype and its forward passes run there (sweep: the LM head "
    "and the per-token statistics too, copied to the CPU once per batch, where the exit strategies and the "
    "report are computed). Default auto: CUDA in bfloat16 when torch.cuda.is_available(), else the CPU in float32."
)


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") from None


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of numbers") from None


def load_data(
    spec: str,
    seed: int = 0,
    *,
    seq_len: int = 256,
    batch_size: int = 8,
    vocab_size: int | None = None,
    checkpoint: str | None = None,
):
    """The --data argument -> a dataset titanloop.eval accepts (see DATA_HELP). With `checkpoint`, shards must have
    been written with the tokenizer the checkpoint names (fingerprints compared as training compares them)."""
    import torch  # (CLI: `--help` and argument errors answer before torch is imported)

    from titanloop.checkpoint.loading import check_tokenizer, checkpoint_tokenizer  # (CLI: as torch)
    from titanloop.data import DataConfig
    from titanloop.data.shard_format import MANIFEST
    from titanloop.data.shards import read_manifest, whole_set_batches

    own = checkpoint_tokenizer(checkpoint) if checkpoint is not None else None

    if spec.startswith("task:"):
        return DataConfig(kind="synthetic_task", task=spec[len("task:") :], split="eval", seed=seed)
    if spec == "synthetic_text":
        return DataConfig(kind="synthetic_text", seed=seed)
    path = Path(spec)
    if path.is_dir() and (path / MANIFEST).is_file():
        if own is not None:  # the manifest's fingerprint against the checkpoint's tokenizer, before a token is read
            written_with = read_manifest(str(path)).tokenizer.get("fingerprint")
            check_tokenizer(
                checkpoint,
                str(written_with),
                f"--data={spec!r}",
                "re-tokenize the data with the checkpoint's tokenizer",
            )
        shards = DataConfig(kind="shards", sources=[{"path": str(path)}], tokenizer=own)
        return whole_set_batches(shards, seq_len=seq_len, vocab_size=vocab_size or 2**31, batch_size=batch_size)
    if not path.is_file():
        raise ConfigError(f"--data={spec!r} is invalid: {DATA_HELP}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--data={spec!r} is not a UTF-8 text file: {DATA_HELP}") from None
    if path.suffix == ".json":
        try:
            cfg = DataConfig.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise ConfigError(f"--data={spec!r}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if own is not None and cfg.kind not in ("synthetic_task", "synthetic_text") and cfg.tokenizer is None:
            cfg.tokenizer = own  # the loader then refuses shards of another tokenizer, as training does
        return cfg
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--data={spec!r} line {n}: not valid JSON ({e.msg})") from None
        if isinstance(item, dict) and "labels" in item:
            rows.append({"input_ids": torch.tensor([item["input_ids"]]), "labels": torch.tensor([item["labels"]])})
        elif isinstance(item, dict):
            rows.append(item.get("input_ids") or item.get("tokens") or [])
        else:
            rows.append(item)
    return rows


def _sweep(args) -> None:
    from titanloop.checkpoint.loading import checkpoint_model_config  # (CLI: torch only once needed)
    from titanloop.eval import EvalConfig, evaluate, load_model, write_report

    cfg = EvalConfig(
        loops=args.loops,
        exit_loops=args.exit_loops,
        batch_size=args.batch_size,
        max_batches=args.max_batches,
        seq_len=args.seq_len,
        chunk_size=args.chunk_size,
        hidden_eps=args.hidden_eps,
        jsrr_loops=args.jsrr_loops,
        jsrr_rows=args.jsrr_rows,
        jsrr_power_steps=args.jsrr_power_steps,
        diagnostics=not args.no_diagnostics,
    )
    for name in ("q", "margin", "ash_eps", "ash_patience"):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, {"q": "q_thresholds", "margin": "margin_thresholds"}.get(name, name), value)
    # everything that can be checked without the weights first: --out, the options against the model's config, the
    # data (and its tokenizer against the checkpoint's), so a bad argument answers in seconds, not after the load
    check_output(args.out, "--out", overwrite=args.overwrite, kind="dir", inputs=[("the checkpoint", args.checkpoint)])
    model_cfg = checkpoint_model_config(args.checkpoint)
    cfg.validate(model_cfg)
    dataset = load_data(
        args.data,
        args.seed,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        vocab_size=model_cfg.vocab_size,
        checkpoint=args.checkpoint,
    )
    print(f"loading {args.checkpoint} on {args.device} in {_dtype_name(args.dtype)}", flush=True)
    model = load_model(args.checkpoint, device=args.device, dtype=args.dtype)
    report = evaluate(
        model,
        dataset,
        cfg,
        progress=lambda m: print(m, flush=True),
        meta={
            "checkpoint": str(args.checkpoint),
            "data": args.data,
            "device": str(args.device),
            "dtype": _dtype_name(args.dtype),
        },
    )
    paths = write_report(report, args.out)
    print(f"\n{'loops':>5} {'loss':>8} {'ppl':>10} {'tok_acc':>8} {'seq_acc':>8}")
    for p in report["depth_sweep"]["points"]:
        print(
            f"{p['loops']:>5} {p['loss']:>8.4f} {p['perplexity']:>10.3f} {p['token_accuracy']:>8.4f} "
            f"{p['sequence_accuracy']:>8.4f}"
        )
    fr = report["exit_frontier"]
    print("\nPareto frontier (loss):")
    for i in fr["pareto"]["loss"]:
        p = fr["points"][i]
        print(f"  {p['strategy']:<12} {json.dumps(p['param']):<24} avg_loops={p['avg_loops']:.3f} loss={p['loss']:.4f}")
    print("\nwrote " + ", ".join(paths.values()))


def _compare(args) -> None:
    from titanloop.eval.compare import depth_curves, format_table, write_depth_comparison  # (CLI: as torch)

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    curves = depth_curves(args.sources, labels)
    paths = write_depth_comparison(curves, args.out, args.title)
    print(format_table(curves))
    print("\nwrote " + ", ".join(paths.values()))


def _generate(args) -> None:
    import torch  # (CLI: torch only once a subcommand runs)

    from titanloop.checkpoint.loading import check_tokenizer, checkpoint_tokenizer  # torch: only for a command
    from titanloop.data.tokenizer import find_eos_id, load_tokenizer
    from titanloop.eval import load_model  # (CLI: as torch)
    from titanloop.eval.generate import GenerationConfig, generate

    tokenizer = None
    if args.prompt is not None:
        path = args.tokenizer or checkpoint_tokenizer(args.checkpoint)
        if path is None:
            raise ConfigError(
                f"--prompt needs a tokenizer: {args.checkpoint} names none (no tokenizer.json beside it, no [data] "
                "tokenizer in its config); pass --tokenizer tokenizer.json"
            )
        if args.tokenizer is not None:  # text through another tokenizer would be other ids than the model learned
            check_tokenizer(
                args.checkpoint, args.tokenizer, f"--tokenizer={args.tokenizer!r}", "pass it, or leave out --tokenizer"
            )
        tokenizer = load_tokenizer(path)
        encoding = tokenizer.encode(args.prompt, add_special_tokens=False)
        prompt_ids = encoding.ids
        if not prompt_ids:
            raise ConfigError("--prompt is empty: give some text to continue, e.g. --prompt 'ROMEO:'")
        _check_unknown(tokenizer, encoding, args.prompt, args.allow_unknown)
    else:
        prompt_ids = args.prompt_ids
        if not prompt_ids:
            raise ConfigError("--prompt-ids is empty: expected a comma-separated list of token ids, e.g. 5,17,3")
    eos = args.eos_token_id
    if eos is None and tokenizer is not None:
        try:
            eos = find_eos_id(tokenizer)  # text stops at the end-of-text token the shards put after documents
        except ConfigError:
            eos = None
    model = load_model(args.checkpoint, device=args.device, dtype=args.dtype)
    cfg = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        n_loops=args.n_loops,
        cache_policy=args.cache_policy,
        exit_policy=args.exit_policy,
        q=args.q,
        exit_kv=args.exit_kv,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        eos_token_id=eos,
        context=args.context,
    )
    out = generate(model, torch.tensor([prompt_ids]), cfg)
    stats = {
        "new_tokens": out.new_tokens[0].tolist(),
        "exit_loops": out.exit_loops[0].tolist(),
        "loops_run": out.loops_run,
        "cache_bytes": out.cache_bytes,
        "full_cache_bytes": out.full_cache_bytes,
        "prefill_cache_bytes": out.prefill_cache_bytes,
        "memory_reduction": round(out.memory_reduction, 3),
        "device": str(args.device),
        "dtype": _dtype_name(args.dtype),
    }
    if tokenizer is None:
        print(json.dumps(stats))
        return
    # text in, text out: the prompt and its continuation on stdout, the numbers on stderr
    print(args.prompt + tokenizer.decode(stats["new_tokens"], skip_special_tokens=True), flush=True)
    exits = stats.pop("exit_loops")
    stats.update(new_tokens=len(stats.pop("new_tokens")), mean_exit_loop=round(sum(exits) / len(exits), 3))
    stats["loops_run"] = round(sum(stats["loops_run"]) / len(stats["loops_run"]), 3)
    print(json.dumps(stats), file=sys.stderr)


def _check_unknown(tokenizer, encoding, prompt: str, allow: bool) -> None:
    """Characters of the prompt the tokenizer has no token for (they encode as its unknown token): an error naming
    them, or with --allow-unknown a warning with their count."""
    unk = getattr(tokenizer.model, "unk_token", None)
    unk_id = tokenizer.token_to_id(unk) if unk else None
    if unk_id is None:
        return
    spans = [encoding.offsets[i] for i, t in enumerate(encoding.ids) if t == unk_id]
    if not spans:
        return
    chars = sorted({prompt[a:b] for a, b in spans})
    n = sum(b - a for a, b in spans)
    shown = ", ".join(repr(c) for c in chars[:10]) + (f" and {len(chars) - 10} more" if len(chars) > 10 else "")
    if not allow:
        raise ConfigError(
            f"--prompt has {n} character(s) the tokenizer lacks ({shown}); they would become {unk}: remove them, or "
            "pass --allow-unknown to generate anyway"
        )
    print(f"warning: --prompt has {n} character(s) the tokenizer lacks ({shown}), encoded as {unk}", file=sys.stderr)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _add_placement(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help=f"show the traceback of an error ({DEBUG_ENV}=1 too)")
    p.add_argument(
        "--device",
        default="auto",
        help="where the model is loaded and run: auto (default: cuda when torch.cuda.is_available(), else cpu), "
        "cpu, cuda or cuda:N",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="parameter and compute dtype: auto (default: bfloat16 on cuda, float32 on cpu), float32, bfloat16 or "
        "float16",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m titanloop.eval",
        description="Evaluate a looped LM: depth sweep, early-exit frontier, per-loop "
        "diagnostics (sweep), or decode with a KV cache (generate). " + WHERE,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ckpt_help = "checkpoint: an Ouro Hugging Face directory (titanloop.interchange export) or a DCP directory"

    s = sub.add_parser(
        "sweep",
        help="depth sweep + exit strategies + diagnostics -> report.json and PNG plots",
        description="Score the data at T = --loops, run every early-exit strategy over loops "
        "1..--exit-loops, compute per-loop diagnostics; write report.json, "
        "depth_curve.png, pareto.png, hidden_norms.png into --out. " + WHERE,
    )
    s.add_argument("checkpoint", help=ckpt_help)
    _add_placement(s)
    s.add_argument("--data", required=True, help=DATA_HELP)
    s.add_argument(
        "--out", default="eval_out", help="output directory, new or empty unless --overwrite (default: eval_out)"
    )
    s.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out, replacing the report.json and plots of an earlier sweep there",
    )
    s.add_argument(
        "--loops",
        type=_ints,
        default=None,
        help="loop counts T to sweep, e.g. 1,2,4,8; any T >= 1 (default 1,2,3,4,6,8,12,16,24,32,48,64 and the "
        "trained depth, capped at max_loops for per_loop_norm models; one forward to the deepest T scores them all)",
    )
    s.add_argument(
        "--exit-loops", type=int, default=None, help="T_max for the exit strategies (default: the deepest swept T)"
    )
    s.add_argument("--q", type=_floats, default=None, help="Q-exit thresholds in [0,1] (default 0,0.1,...,1)")
    s.add_argument(
        "--margin", type=_floats, default=None, help="logit-margin thresholds (top-1 minus top-2 probability) in [0,1]"
    )
    s.add_argument(
        "--hidden-eps",
        type=_floats,
        default=None,
        help="hidden-difference thresholds (RMS change of the normalized state; default: data quantiles)",
    )
    s.add_argument("--ash-eps", type=_floats, default=None, help="ASH thresholds on ||Δsoftmax||_1, in [0,2]")
    s.add_argument("--ash-patience", type=_ints, default=None, help="ASH consecutive loops m (default 1,2)")
    s.add_argument(
        "--jsrr-loops",
        type=_ints,
        default=None,
        help="loops t at whose input x_{t-1} to estimate the spectral radius of the recurrent map, e.g. 5,17 for "
        "x_4 and x_16 (default 1, the trained depth and twice it)",
    )
    s.add_argument("--jsrr-rows", type=int, default=2, help="rows of the first batch the spectral radius uses")
    s.add_argument("--jsrr-power-steps", type=int, default=10, help="power-iteration steps of the spectral radius")
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--max-batches", type=int, default=None, help="cap on batches (default: all; 8 for loaders)")
    s.add_argument("--seq-len", type=int, default=256, help="row length for shard sets and DataConfig datasets")
    s.add_argument("--chunk-size", type=int, default=1024, help="tokens per LM-head chunk")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-diagnostics", action="store_true", help="skip radial gradient and JSRR")
    s.set_defaults(func=_sweep)

    c = sub.add_parser(
        "compare",
        help="held-out loss against depth for several runs in one picture",
        description="Draw held-out loss against loops T (log scale) for several runs in one picture: each source "
        "is a `sweep` output directory (or its report.json) or a training run directory, whose last validation "
        "(val/loss/loop_T in metrics.jsonl) gives the curve. Writes depth_comparison.png and "
        "depth_comparison.json into --out and prints the table.",
    )
    c.add_argument("sources", nargs="+", help="sweep output directories, report.json files or training run dirs")
    c.add_argument("--labels", default=None, help="comma-separated curve names (default: the directory names)")
    c.add_argument("--out", default="eval_compare", help="output directory (default: eval_compare)")
    c.add_argument("--title", default=None, help="plot title")
    c.set_defaults(func=_compare)

    g = sub.add_parser(
        "generate",
        help="greedy or sampled decoding with a KV cache",
        description="Decode after --prompt (text) or --prompt-ids; prints the text (--prompt) or the new tokens, with "
        "exit loops and KV-cache bytes. " + WHERE,
    )
    g.add_argument("checkpoint", help=ckpt_help)
    _add_placement(g)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        default=None,
        help="prompt text: encoded with --tokenizer (default: the checkpoint's own), the continuation decoded and "
        "printed after it",
    )
    prompt.add_argument("--prompt-ids", type=_ints, default=None, help="comma-separated prompt token ids")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json for --prompt (default: tokenizer.json beside an exported checkpoint, or the training "
        "config's [data] tokenizer)",
    )
    g.add_argument(
        "--allow-unknown",
        action="store_true",
        help="generate even when --prompt has characters the tokenizer lacks (they become its unknown token; a "
        "warning gives their count); without it they are an error",
    )
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument(
        "--context", type=int, default=None, help="tokens a token attends to (default: the model's max_seq_len)"
    )
    g.add_argument("--n-loops", type=int, default=None, help="T (default: trained depth)")
    g.add_argument("--cache-policy", default="full", help="full | last | average | first (ouro §5.4.2)")
    g.add_argument("--exit-policy", default="static", help="static | q_exit")
    g.add_argument("--q", type=float, default=1.0, help="Q-exit threshold in [0,1]")
    g.add_argument("--exit-kv", default="compute", help="compute (run all loops) | copy (stop early, copy K/V)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--eos-token-id", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "device"):  # (compare loads no model, and no torch)
        # (CLI: torch only once the arguments parsed)
        from titanloop.checkpoint.loading import resolve_device, resolve_dtype

        try:  # a bad --device / --dtype is a usage error: one line, exit status 2, before anything is loaded
            args.device = resolve_device(args.device, "--device")
            args.dtype = resolve_dtype(args.dtype, args.device, "--dtype")
        except ConfigError as e:
            parser.exit(2, f"error: {e}\n")
    one_line_errors(args.func, args, debug=debug_enabled(getattr(args, "debug", False)))


if __name__ == "__main__":
    main(sys.argv[1:])
