#!/usr/bin/env python
"""Build a small real-text corpus, with no download, from the docstrings of the Python standard library.

Every module, class and function docstring of the stdlib's ``.py`` files (parsed with ``ast``, never
imported) becomes part of a document: a module's own docstring is one document, and each top-level
class or function (its docstring followed by those of its methods) is another. Output: ``DIR/train.jsonl``
and ``DIR/valid.jsonl`` (every 20th document), key "text". Deterministic for a given Python installation:
files are visited in sorted order. About 1.6 MB of text on Python 3.11. With ``--site-packages`` the
installed packages' docstrings follow the stdlib's (about 30 MB with lnstrain's dependencies), each
distinct document once, for runs that should see more tokens than the stdlib holds without repeating.

    python tools/make_demo_corpus.py --output demo_corpus --max-mb 5
    python tools/make_demo_corpus.py --output big_corpus --max-mb 40 --site-packages
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
import time


def _docstrings(node: ast.AST) -> list[str]:
    """Docstrings of ``node`` and of every class/function inside it, in source order."""
    docs = []
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(sub)
            if doc and len(doc) >= 40 and doc not in docs:
                docs.append(doc)
    return docs


def module_documents(path: str) -> list[str]:
    """Documents of one module: its own docstring, then one per top-level class or function."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    docs = []
    module_doc = ast.get_docstring(tree)
    if module_doc and len(module_doc) >= 40:
        docs.append(module_doc)
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = "\n\n".join(_docstrings(node))
            if len(text) >= 80:
                docs.append(text)
    return docs


def stdlib_files(site_packages: bool = False) -> list[str]:
    """The stdlib's .py files in sorted order, then (with ``site_packages``) the installed packages'."""
    files = _python_files(sysconfig.get_paths()["stdlib"], skip=("site-packages", "dist-packages"))
    if site_packages:
        files += _python_files(sysconfig.get_paths()["purelib"], skip=())
    return files


def _python_files(root: str, skip: tuple[str, ...]) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip + ("test", "tests", "idlelib", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return sorted(files, key=lambda p: os.path.relpath(p, root))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="output folder (gets train.jsonl and valid.jsonl)")
    p.add_argument("--max-mb", type=float, default=5.0, help="stop after this many MB of text (default 5)")
    p.add_argument("--valid-every", type=int, default=20, help="every N-th document goes to valid.jsonl (default 20)")
    p.add_argument("--site-packages", action="store_true",
                   help="after the stdlib, the installed packages' docstrings (repeated documents kept once)")
    args = p.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    t0 = time.perf_counter()
    counts, nbytes = {"train": 0, "valid": 0}, 0
    with open(os.path.join(args.output, "train.jsonl"), "w", encoding="utf-8") as train, \
            open(os.path.join(args.output, "valid.jsonl"), "w", encoding="utf-8") as valid:
        n, seen = 0, set()
        for path in stdlib_files(args.site_packages):
            for text in module_documents(path):
                if args.site_packages:
                    if text in seen:
                        continue
                    seen.add(text)
                n += 1
                split = "valid" if n % args.valid_every == 0 else "train"
                (valid if split == "valid" else train).write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                counts[split] += 1
                nbytes += len(text.encode("utf-8"))
            if nbytes >= args.max_mb * 1e6:
                break
    source = "stdlib and site-packages" if args.site_packages else "stdlib"
    print(f"demo corpus: {counts['train']} train + {counts['valid']} valid documents, {nbytes / 1e6:.2f} MB "
          f"of {source} docstrings in {args.output} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
