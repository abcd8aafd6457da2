#!/usr/bin/env python3
"""Instruction prompts for EAGLE-3 self-distillation, made from the Python standard library on this machine.

Each public function or method with a docstring becomes a coding request ("Write a <language> function that
<first sentence of the docstring>"), in several languages and phrasings, so the target answers the kind of
request a code assistant gets. Public material only: never shared/prompts (the evaluation set).

    python3 scripts/eagle3_prompts.py --count 400 --out train-prompts.jsonl
    python3 scripts/eagle3_prompts.py --count 800 --skip 400 --out more-prompts.jsonl   # the next 400

`--source general` makes general programming requests instead (algorithms, data structures, text processing,
small programs, tests: scripts/eagle3_general_tasks.py) in many languages, phrasings and extra requirements. A
head trained on docstring requests only accepted 2.68 tokens a cycle on unseen requests of that kind but 2.29 on
shared/prompts/code.jsonl (docs/benchmarks.md, session 19): the kind of request matters. `--source general2`
draws on a second set of tasks (later training stages: requests the first stage never saw).

No general task may come close to an evaluation prompt (--exclude; by default the repository's bench/*.jsonl and
../shared/prompts/*.jsonl where they exist): a task is too close when half or more of its content words are
shared with one evaluation prompt's (Jaccard), or 80% of them appear in it; the script then stops and names it.
"""

import argparse
import ast
import json
import random
import re
import sysconfig
from pathlib import Path

import eagle3_general_tasks as general

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


STOPWORDS = set(
    """a an the and or of to in on for with without that this is are be by as at from into its it their them
    write implement create show how do i can you code function class program script using use given returns
    return which while all each every one two its using"""
    .split()
)


def content_words(text: str) -> set[str]:
    words = set(re.findall(r"[a-z0-9]+", text.lower()))
    langs = {w.lower() for w in general.LANGUAGES} | {"c++", "cpp", "js", "sql"}
    return {w for w in words if w not in STOPWORDS and w not in langs and len(w) > 1}


def too_close(task: str, evaluation: list[set[str]]) -> bool:
    mine = content_words(task)
    if not mine:
        return False
    for theirs in evaluation:
        shared = len(mine & theirs)
        if shared / len(mine | theirs) >= 0.5 or shared / len(mine) >= 0.8:
            return True
    return False


def evaluation_prompts(paths: list[Path]) -> list[set[str]]:
    out = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append(content_words(json.loads(line).get("prompt", "")))
    return out


def general_prompts(rng: random.Random, count: int, function_tasks: list[str],
                    artifact_tasks: list[tuple[str, str]], prefix: str = "general") -> list[str]:
    """`count` general requests from these tasks (deterministic for a seed)."""
    combos = []
    for i, task in enumerate(function_tasks):
        for t in range(len(general.FUNCTION_TEMPLATES)):
            combos.append(("f", i, t))
    for i, _ in enumerate(artifact_tasks):
        for t in range(len(general.ARTIFACT_TEMPLATES)):
            combos.append(("a", i, t))
    rng.shuffle(combos)
    lines = []
    seen = set()
    round_ = 0
    while len(lines) < count:
        round_ += 1
        before = len(lines)
        for kind, i, t in combos:
            if len(lines) >= count:
                break
            lang = rng.choice(general.LANGUAGES)
            extra = rng.choice(general.EXTRAS)
            if kind == "f":
                task = function_tasks[i]
                text = general.FUNCTION_TEMPLATES[t].format(lang=lang, task=task, extra=extra, Extra=extra[:1].upper() + extra[1:])
            else:
                what, task = artifact_tasks[i]
                if what.startswith("SQL"):
                    lang = rng.choice(["PostgreSQL", "SQLite", "MySQL"])
                elif lang in ("Rust", "Go", "C"):
                    what = what.replace("class", "struct")
                text = general.ARTIFACT_TEMPLATES[t].format(lang=lang, kind=what, task=task, extra=extra, Extra=extra[:1].upper() + extra[1:])
            # The same request twice gets the same greedy answer: one copy only.
            if text in seen:
                continue
            seen.add(text)
            lines.append(json.dumps({"id": f"{prefix}:{kind}{i}.{t}#{round_}", "prompt": text}))
        if len(lines) == before:
            break
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N prompts (made by an earlier stage)")
    ap.add_argument("--source", choices=["stdlib", "general", "general2", "general3", "general4", "general5"], default="stdlib",
                    help="general2 to general5: the second to fifth sets of general tasks (later training stages)")
    ap.add_argument("--exclude", type=Path, nargs="*", default=None,
                    help="evaluation prompt files (JSONL with a prompt field) whose requests must stay unseen")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.source in ("general", "general2", "general3", "general4", "general5"):
        function_tasks, artifact_tasks = {
            "general": (general.FUNCTION_TASKS, general.ARTIFACT_TASKS),
            "general2": (general.FUNCTION_TASKS_2, general.ARTIFACT_TASKS_2),
            "general3": (general.FUNCTION_TASKS_3, general.ARTIFACT_TASKS_3),
            "general4": (general.FUNCTION_TASKS_4, general.ARTIFACT_TASKS_4),
            "general5": (general.FUNCTION_TASKS_5, general.ARTIFACT_TASKS_5),
        }[args.source]
        repo = Path(__file__).resolve().parent.parent
        exclude = args.exclude
        if exclude is None:
            exclude = sorted((repo / "bench").glob("*.jsonl")) + sorted((repo.parent / "shared" / "prompts").glob("*.jsonl"))
        evaluation = evaluation_prompts(exclude)
        tasks_ = function_tasks + [" ".join(a) for a in artifact_tasks]
        close = [t for t in tasks_ if too_close(t, evaluation)]
        if close:
            raise SystemExit(f"general tasks too close to an evaluation prompt (remove them): {close}")
        lines = general_prompts(random.Random(args.seed), args.count, function_tasks, artifact_tasks,
                                args.source)[args.skip :]
        args.out.write_text("\n".join(lines) + "\n")
        print(f"{len(lines)} {args.source} prompts from {len(tasks_)} tasks (none close to the {len(evaluation)} "
              f"evaluation prompts of {len(exclude)} files) -> {args.out}")
        return
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
