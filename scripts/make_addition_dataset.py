"""Write ``examples/data/addition500.jsonl``: the shipped example of a user's own dataset.

500 distinct 3-digit additions in the built-in model's format (``"123+456="`` -> the sum
reversed, ``"975"``), one JSON object a line, with an id and two extra fields that reach the
reward as ``Prompt.meta`` (the operands' digit count and how many carries the sum makes).
Deterministic: the same bytes on every run (``--check`` verifies the committed file).

    python scripts/make_addition_dataset.py [--out PATH] [--rows 500] [--check]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "examples" / "data" / "addition500.jsonl"
SEED = 20260215


def carries(a: int, b: int) -> int:
    """Carries written when adding ``a`` and ``b`` digit by digit."""
    count = carry = 0
    while a or b:
        carry = (a % 10 + b % 10 + carry) // 10
        count += carry
        a, b = a // 10, b // 10
    return count


def rows(n: int) -> list[dict[str, object]]:
    rng = random.Random(SEED)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < n:
        pairs.setdefault((rng.randrange(100, 1000), rng.randrange(100, 1000)))
    return [
        {
            "id": f"add-{i:04d}",
            "question": f"{a}+{b}=",
            "answer": str(a + b)[::-1],
            "digits": 3,
            "carries": carries(a, b),
        }
        for i, (a, b) in enumerate(pairs)
    ]


def render(n: int) -> str:
    return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from what would be written")
    args = parser.parse_args(argv)
    text = render(args.rows)
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from the generator'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.rows} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
