"""Command line for Ouro Hugging Face directories.

    python -m titanloop.interchange inspect DIR                 config summary + parameter count (headers only)
    python -m titanloop.interchange export --preset debug-tiny --out DIR [--set n_loops=2] [--dtype bfloat16]
    python -m titanloop.interchange export --checkpoint runs/x/checkpoints --out DIR      a trained model, with its
                                                                tokenizer.json (--tokenizer, default the run's own)
    python -m titanloop.interchange verify DIR                  import, export to a temp dir, compare bitwise

`export` refuses a non-empty --out unless --overwrite is given (then the previous export's weights, config.json and
tokenizer.json are replaced; a tokenizer.json is never left from another model). A trained checkpoint is checked
before export as a resume checks it (size and crc32 of every file), and a NaN or infinite weight is refused. Errors
are one line; --debug (or TITANLOOP_DEBUG=1) shows the traceback.

`export` writes a trained checkpoint (--checkpoint: a titanloop DCP checkpoint or folder, and its tokenizer.json
beside the weights, so Hugging Face code, `titanloop.eval generate --prompt` and the lm-eval adapter find it), or a
freshly initialized model of a preset (seeded), e.g. to hand a tiny Ouro checkpoint to evaluation code.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile

import torch

from titanloop.cli import DEBUG_ENV, check_output, debug_enabled, one_line_errors, resolved
from titanloop.config_errors import ConfigError
from titanloop.interchange.ouro_hf import _DTYPES, DEFAULT_MAX_SHARD_BYTES, export_ouro_hf, import_ouro_hf, summarize
from titanloop.model import LoopLM, LoopLMConfig, preset


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a bare string such as readout=raw


def _overrides(pairs: list[str]) -> dict:
    fields = sorted(LoopLMConfig().to_dict())
    out = {}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        if not sep or k not in fields:
            raise ConfigError(f"--set {pair!r} is invalid: expected FIELD=VALUE with FIELD one of {fields}")
        out[k] = _parse_value(v)
    return out


def cmd_inspect(args) -> None:
    s = summarize(args.path)
    c = s["config"]
    print(f"{s['path']}: Ouro LoopLM, {s['n_files']} safetensors file(s), dtype(s) {', '.join(s['dtypes'])}")
    print(
        f"  layers={c['n_layers']} hidden={c['hidden_size']} heads={c['n_heads']} "
        f"kv_heads={c['n_kv_heads'] or c['n_heads']} ffn={c['ffn_hidden_size']} vocab={c['vocab_size']}"
    )
    print(
        f"  loops T={c['n_loops']} (max_loops={c['max_loops']}) rope_theta={c['rope_theta']} "
        f"max_seq_len={c['max_seq_len']} tie_embeddings={c['tie_embeddings']}"
    )
    print(
        f"  variants: readout={c['readout']} inter_loop_norm={c['inter_loop_norm']} "
        f"prelude={c['n_prelude_layers']} coda={c['n_coda_layers']} gated_recurrence={c['gated_recurrence']} "
        f"per_loop_norm={c['per_loop_norm']}"
    )
    print(f"  parameters: {s['stored_params']:,} stored ({s['stored_params'] / 1e6:.2f}M)")


def cmd_export(args) -> None:
    # the target and the inputs first: a refused --out answers before any model is loaded or built
    out = check_output(
        args.out,
        "--out",
        overwrite=args.overwrite,
        kind="dir",
        inputs=[("--checkpoint", args.checkpoint), ("--tokenizer", args.tokenizer)],
    )
    if args.tokenizer is not None:
        from titanloop.data.tokenizer import tokenizer_fingerprint  # tokenizers: only when one is copied

        tokenizer_fingerprint(args.tokenizer)  # a missing or broken file is refused before anything is loaded
    tokenizer = None
    if args.checkpoint:
        # a training checkpoint needs the trainer's loader (torch, DCP); an HF export alone does not
        from titanloop.checkpoint.loading import checkpoint_tokenizer, load_model

        if args.set:
            raise ConfigError("--set changes a preset's fields: it does not go with --checkpoint (a trained model)")
        model = load_model(args.checkpoint)
        tokenizer = args.tokenizer or checkpoint_tokenizer(args.checkpoint)
        print(f"loaded {args.checkpoint} ({model.num_params():,} params) ...", file=sys.stderr)
    else:
        cfg = preset(args.preset, **_overrides(args.set))
        torch.manual_seed(args.seed)
        print(f"building {args.preset} ({cfg.param_count():,} params) ...", file=sys.stderr)
        model = LoopLM(cfg)
        tokenizer = args.tokenizer
    if tokenizer is not None:
        from titanloop.data.tokenizer import tokenizer_fingerprint  # tokenizers: only when one is copied

        tokenizer_fingerprint(tokenizer)  # a missing or broken file is refused before anything is written
    out = export_ouro_hf(
        model,
        out,
        dtype=_DTYPES[args.dtype] if args.dtype else None,
        max_shard_bytes=args.max_shard_bytes,
        allow_variant=args.allow_variant,
    )
    if tokenizer is not None:
        if resolved(tokenizer) != resolved(out / "tokenizer.json"):  # (--overwrite with the one already there)
            shutil.copyfile(tokenizer, out / "tokenizer.json")
    else:  # a previous export's tokenizer would be taken for this model's by eval generate and Hugging Face code
        (out / "tokenizer.json").unlink(missing_ok=True)
    print(f"wrote {out}" + (f" with {tokenizer} as tokenizer.json" if tokenizer else ""))


def cmd_verify(args) -> None:
    from titanloop.checkpoint.loading import refuse_nonfinite  # (a module that imports this package's ouro_hf)

    model = import_ouro_hf(args.path)
    refuse_nonfinite(model, args.path)
    with tempfile.TemporaryDirectory() as tmp:
        export_ouro_hf(model, tmp, allow_variant=True)  # whatever it was (ouro or a titanloop variant)
        again = import_ouro_hf(tmp)
    a, b = model.state_dict(), again.state_dict()
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    if bad:
        raise SystemExit(f"error: round trip changed {len(bad)} tensor(s), first {bad[0]!r}")
    print(f"ok: {len(a)} tensors round-trip bitwise")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m titanloop.interchange",
        description="Export/import/inspect LoopLMs as Ouro Hugging Face directories "
        "(config.json model_type 'ouro' + safetensors).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    pi = sub.add_parser("inspect", help="print the config summary and parameter count of an Ouro directory")
    pi.add_argument("path")
    pi.set_defaults(fn=cmd_inspect)
    pe = sub.add_parser("export", help="write a trained checkpoint (or a fresh preset model) as an Ouro directory")
    pe.add_argument("--checkpoint", default=None, help="a trained titanloop checkpoint to export (else --preset)")
    pe.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json to write beside the weights (default with --checkpoint: the run's [data] tokenizer)",
    )
    pe.add_argument("--preset", default="debug-tiny", help="model preset of a fresh model (default debug-tiny)")
    pe.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a LoopLMConfig field, e.g. --set readout=raw (repeatable)",
    )
    pe.add_argument("--out", required=True, help="output directory: new or empty (else --overwrite)")
    pe.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the export in a non-empty --out (its weights, config.json and tokenizer.json)",
    )
    pe.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="tensor dtype (default float32)")
    pe.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="split weights into shards above this size (default 5e9, as Hugging Face)",
    )
    pe.add_argument("--seed", type=int, default=0)
    pe.add_argument(
        "--allow-variant",
        action="store_true",
        help="write a variant the Ouro HF code cannot compute (e.g. readout=raw) under model_type "
        "'titanloop_looplm' instead of refusing it",
    )
    pe.set_defaults(fn=cmd_export)
    pv = sub.add_parser("verify", help="import a directory, re-export it and check the tensors are bitwise equal")
    pv.add_argument("path")
    pv.set_defaults(fn=cmd_verify)
    for sp in (pi, pe, pv):
        sp.add_argument("--debug", action="store_true", help=f"show the traceback of an error ({DEBUG_ENV}=1 too)")
    args = p.parse_args(argv)
    one_line_errors(args.fn, args, debug=debug_enabled(args.debug))


if __name__ == "__main__":
    main()
