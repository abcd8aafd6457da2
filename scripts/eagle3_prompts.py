#!/usr/bin/env python3
"""Instruction prompts for EAGLE-3 self-distillation, made from the Python standard library on this machine.

Each public function or method with a docstring becomes a coding request ("Write a <language> function that
<first sentence of the docstring>"), in several languages and phrasings, so the target answers the kind of
request a code assistant gets. Public material only: never shared/prompts (the evaluation set).

    python3 scripts/eagle3_prompts.py --count 400 --out train-prompts.jsonl
    python3 scripts/eagle3_prompts.py --count 800 --skip 400 --out more-prompts.jsonl   # the next 400
"""

import argparse
import ast
import json
import random
import re
import sysconfig
from pathlib import Path

LANGUAGES = ["Python"] * 5 + ["Rust", "JavaScript", "C", "Go", "TypeScript", "Java", "C++"]
TEMPLATES = [
    "Write a {lang} function that {task}",
    "Implement a {lang} function `{name}` that {task} Include a short docstring or comment.",
    "In {lang}, write code that {task} Add a small usage example.",
    "Write a {lang} function that {task} Use type hints where the language has them, and explain it briefly.",
    "Show how to write a {lang} function named {name} that {task}",
]


def first_sentence(doc: str) -> str | None:
    text = " ".join(doc.strip().split())
    m = re.match(r"(.{20,200}?[.!?])(\s|$)", text)
    if not m:
        return None
    s = m.group(1)
    if any(bad in s for bad in ("XXX", "TODO", "Deprecated", "deprecated", ">>>", "::")):
        return None
    # "Return the x." -> "returns the x."
    words = s.split(" ", 1)
    verb = words[0]
    if verb[:1].isupper() and verb.isalpha() and len(words) > 1:
        verb = verb.lower()
        if not verb.endswith("s") and verb not in ("do", "go"):
            verb += "es" if verb.endswith(("sh", "ch", "x")) else "s"
        s = verb + " " + words[1]
    return s


def tasks(root: Path):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in rel for part in ("test", "site-packages", "idlelib", "turtledemo", "lib2to3")):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc:
                    s = first_sentence(doc)
                    if s:
                        yield node.name, s, rel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N prompts (made by an earlier stage)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    found = list(tasks(root))
    rng = random.Random(args.seed)
    rng.shuffle(found)
    seen = set()
    unique = []
    for name, task, rel in found:
        if task not in seen:
            seen.add(task)
            unique.append((name, task, rel))
    # Round 1 takes each task once; past that (a --count above the tasks found) each task comes again in another
    # language and phrasing (the target's answer differs), as many rounds as needed.
    lines = []
    for round_ in range(1, 1 + -(-args.count // max(1, len(unique)))):
        for name, task, rel in unique:
            if len(lines) >= args.count:
                break
            prompt = rng.choice(TEMPLATES).format(lang=rng.choice(LANGUAGES), name=name, task=task)
            pid = f"{rel}:{name}" + ("" if round_ == 1 else f"#{round_}")
            lines.append(json.dumps({"id": pid, "prompt": prompt}))
    lines = lines[args.skip :]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} prompts from {len(unique)} tasks ({len(found)} documented functions) under {root} -> {args.out}")


if __name__ == "__main__":
    main()
