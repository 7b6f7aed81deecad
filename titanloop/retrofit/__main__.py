"""`python -m titanloop.retrofit export --checkpoint <run_dir>/checkpoints --out <dir>`

Writes a retrofit run's model as a Hugging Face directory of model_type "titanloop_retrofit" (own remote code;
load with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)). Bad input: one line, exit 2; a non-empty
--out is refused unless --overwrite.
"""

from __future__ import annotations

import argparse
import sys

from titanloop.cli import check_output
from titanloop.config_errors import cli_errors


@cli_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titanloop.retrofit", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="export a retrofit training checkpoint as a titanloop_retrofit HF dir")
    ex.add_argument("--checkpoint", required=True, help="DCP step dir, or the checkpoint folder (newest step)")
    ex.add_argument("--out", required=True, help="output directory, new or empty (else --overwrite)")
    ex.add_argument("--overwrite", action="store_true", help="write into a non-empty --out, replacing its files")
    args = ap.parse_args(argv)
    check_output(args.out, "--out", overwrite=args.overwrite, kind="dir", inputs=[("--checkpoint", args.checkpoint)])
    from titanloop.retrofit.export import export_from_checkpoint  # (CLI: `--help` answers before torch is imported)

    out = export_from_checkpoint(args.checkpoint, args.out)
    print(f"wrote {out} (model_type titanloop_retrofit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
