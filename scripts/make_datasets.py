"""Write the two small example datasets of `configs/dataset-example.yaml`, deterministically (seeded).

    .venv/bin/python scripts/make_datasets.py OUT_DIR [--rows N] [--seed S]

- `OUT_DIR/wordmath.jsonl`: multi-line word problems with non-ASCII names and units (Zoë, José, €, …), columns
  `question` (the prompt), `answer` (an int) and `kind` (the template); verifier `numeric`.
- `OUT_DIR/quiz.parquet`: multiple choice with 4 or 5 options rendered into the multi-line prompt, columns
  `question`, `answer` (the letter), `choices` (the option texts, in letter order) and `kind`; verifier `choice`.

- `OUT_DIR/corpus.txt`: every prompt and answer of both, plus the example's system messages: the text to train the
  example's byte-level BPE tokenizer on (`alloy model init --tokenizer bpe --train-text OUT_DIR/corpus.txt`).

Both datasets have N distinct prompts (default 3000). The tasks are meant to be learnable by a tiny model: small numbers, few
templates, the answer a function of the prompt. Only the standard library, pandas and pyarrow are used.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Zoë", "José", "Chloé", "Björn", "Søren", "Łukasz", "Ana", "Mei", "Nadia", "François", "Ingrid", "Dąbrowska")
ITEMS = ("apples", "croissants", "stamps", "pencils", "crêpes", "marbles", "tickets", "pretzels")
WORDS = ("Äpfel", "Brötchen", "Café", "Dürer", "Éclair", "Fjörd", "Gâteau", "Höhle", "Île", "Jalapeño", "Kümmel",
         "Löwe", "Mañana", "Niño", "Øre", "Piñata", "Quäker", "Rösti", "Smørrebrød", "Tōkyō", "Über", "Vögel",
         "Wünsch", "Zürich")
LETTERS = "ABCDE"
SYSTEMS = ("Answer with a number.", "Answer with the letter of the right option.")  # configs/dataset-example.yaml


def wordmath_row(rng: random.Random) -> dict:
    """One word problem: a few lines of text, the answer an int in [0, 60]."""
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    who, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.choice(("add", "sub", "mul", "euro"))
    if kind == "add":
        q = f"{who} has {a} {item}.\n{other} gives {who} {b} more.\nHow many {item} does {who} have now?"
        ans = a + b
    elif kind == "sub":
        a, b = max(a, b), min(a, b)
        q = f"{who} had {a} {item}.\n{who} gave {b} of them to {other}.\nHow many {item} are left?"
        ans = a - b
    elif kind == "mul":
        a, b = rng.randint(2, 6), rng.randint(2, 9)
        q = f"{who} buys {a} bags.\nEach bag holds {b} {item}.\nHow many {item} is that in total?"
        ans = a * b
    else:
        price, n = rng.randint(1, 9), rng.randint(2, 6)
        q = f"One café crème costs {price} €.\n{who} orders {n} of them for the table.\nHow many € is the bill?"
        ans = price * n
    return {"question": q, "answer": ans, "kind": kind}


def quiz_row(rng: random.Random) -> dict:
    """One multiple-choice question with 4 or 5 options; the answer is the letter of the right option."""
    k = rng.choice((4, 5))
    kind = rng.choice(("largest", "smallest", "sum", "word"))
    if kind in ("largest", "smallest"):
        opts = [str(x) for x in rng.sample(range(1, 50), k)]
        pick = max if kind == "largest" else min
        right = str(pick(int(o) for o in opts))
        head = f"Which number is the {kind}?"
    elif kind == "sum":
        a, b = rng.randint(1, 15), rng.randint(1, 15)
        wrong = rng.sample([x for x in range(max(0, a + b - 6), a + b + 7) if x != a + b], k - 1)
        opts = [str(x) for x in wrong + [a + b]]
        rng.shuffle(opts)
        right = str(a + b)
        head = f"{rng.choice(NAMES)} adds {a} and {b}.\nWhich option is the sum?"
    else:
        opts = rng.sample(WORDS, k)
        right = rng.choice(opts)
        head = f"Which word starts with «{right[0]}»?"
    lines = [f"{LETTERS[i]}) {o}" for i, o in enumerate(opts)]
    q = "\n".join([head, *lines, "Answer with the letter."])
    return {"question": q, "answer": LETTERS[opts.index(right)], "choices": opts, "kind": kind}


def distinct_rows(make, rng: random.Random, n: int) -> list[dict]:
    """n rows with distinct prompts (the templates' prompt space is far larger than a few thousand)."""
    rows, seen = [], set()
    for _ in range(100 * n + 1000):
        if len(rows) == n:
            break
        row = make(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    if len(rows) < n:
        raise SystemExit(f"only {len(rows)} distinct rows could be made, {n} asked")
    return rows


def write_datasets(out_dir: str | Path, rows: int = 3000, seed: int = 0) -> dict[str, Path]:
    """Write both datasets under `out_dir`; returns {name: path}."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wm = distinct_rows(wordmath_row, random.Random(f"wordmath|{seed}"), rows)
    wm_path = out / "wordmath.jsonl"
    wm_path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in wm), encoding="utf-8")
    quiz = distinct_rows(quiz_row, random.Random(f"quiz|{seed}"), rows)
    quiz_path = out / "quiz.parquet"
    pd.DataFrame(quiz, columns=["question", "answer", "choices", "kind"]).to_parquet(quiz_path, index=False)
    corpus = out / "corpus.txt"
    texts = [*SYSTEMS, *(f"{r['question']}\n{r['answer']}" for r in [*wm, *quiz])]
    corpus.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    return {"wordmath": wm_path, "quiz": quiz_path, "corpus": corpus}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", help="folder to write wordmath.jsonl, quiz.parquet and corpus.txt into (created if missing)")
    ap.add_argument("--rows", type=int, default=3000, help="distinct rows per dataset (default 3000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generators (default 0)")
    args = ap.parse_args(argv)
    if args.rows < 1:
        ap.error("--rows must be at least 1")
    for name, path in write_datasets(args.out_dir, args.rows, args.seed).items():
        print(f"wrote {name}: {path}" + ("" if name == "corpus" else f" ({args.rows} rows)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
