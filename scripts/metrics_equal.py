"""Whether two runs' metrics.jsonl are equal bitwise, wall-clock fields excluded: a refactor's behaviour check.

    python scripts/metrics_equal.py runs/before/metrics.jsonl runs/after/metrics.jsonl

Every field of every logged step must be equal (floats compared exactly, as written), except the fields that
measure wall-clock time: `time/*`, `tokens_per_s`, `tflops`, `mfu` and `val/seconds`. Prints the first
difference and exits 1, or prints how many steps and fields matched and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys

WALL_CLOCK = ("tokens_per_s", "tflops", "mfu", "val/seconds")


def _kept(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in WALL_CLOCK and not k.startswith("time/")}


def compare(a: list[dict], b: list[dict]) -> str | None:
    """None when equal, else one line naming the first difference."""
    if len(a) != len(b):
        return f"{len(a)} logged steps vs {len(b)}"
    for ra, rb in zip(a, b):
        ka, kb = _kept(ra), _kept(rb)
        if set(ka) != set(kb):
            return f"step {ra.get('step')}: fields differ: {sorted(set(ka) ^ set(kb))}"
        for key in ka:
            if ka[key] != kb[key]:
                return f"step {ra.get('step')}: {key} = {ka[key]!r} vs {kb[key]!r}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", help="metrics.jsonl of the reference run")
    p.add_argument("after", help="metrics.jsonl of the run to compare")
    args = p.parse_args(argv)
    rows = []
    for path in (args.before, args.after):
        try:
            with open(path) as f:
                rows.append([json.loads(line) for line in f if line.strip()])
        except (OSError, json.JSONDecodeError) as e:
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            return 2
    diff = compare(*rows)
    if diff:
        print(f"different: {diff}")
        return 1
    fields = sum(len(_kept(r)) for r in rows[0])
    print(f"equal: {len(rows[0])} logged steps, {fields} fields (wall-clock fields excluded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
