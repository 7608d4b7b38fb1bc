#!/usr/bin/env python
"""Build a small real-text corpus, with no download, from the docstrings of the Python standard library.

Every module, class and function docstring of the stdlib's ``.py`` files (parsed with ``ast``, never
imported) becomes part of a document: a module's own docstring is one document, and each top-level
class or function (its docstring followed by those of its methods) is another. Output: ``DIR/train.jsonl``
and ``DIR/valid.jsonl`` (every 20th document), key "text", and ``DIR/manifest.json``, which pins the
corpus: each source file that gave a document, with the distribution that installed it and its
SHA-256. About 1.6 MB of text on Python 3.11. With ``--site-packages`` the installed packages'
docstrings follow the stdlib's (about 30 MB with lnstrain's dependencies), each distinct document once,
for runs that should see more tokens than the stdlib holds without repeating.

What is installed decides what such a corpus holds, so the same command gives another corpus on another
machine. ``--from-manifest`` builds a manifest's corpus again, bit for bit: each file is taken from this
Python's stdlib (or ``--stdlib``, a CPython ``Lib/`` folder), the installed packages, or a wheel or
source archive of the recorded version in ``--packages`` (read, never installed); it exits 2 naming
what is missing, with the ``pip download`` lines that fetch it, and checks both outputs against the
manifest's SHA-256.

    python tools/make_demo_corpus.py --output demo_corpus --max-mb 5
    python tools/make_demo_corpus.py --output big_corpus --max-mb 40 --site-packages
    python tools/make_demo_corpus.py --output depth_study/corpus \\
        --from-manifest docs/depth_study/corpus.manifest.json --packages corpus_packages/
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lnstrain.data.docstring_corpus import (  # noqa: E402
    CorpusManifest,
    CorpusSourceError,
    build_corpus,
    default_roots,
    rebuild_from_manifest,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="output folder (gets train.jsonl, valid.jsonl, manifest.json)")
    p.add_argument("--max-mb", type=float, default=5.0, help="stop after this many MB of text (default 5)")
    p.add_argument("--valid-every", type=int, default=20, help="every N-th document goes to valid.jsonl (default 20)")
    p.add_argument("--site-packages", action="store_true",
                   help="after the stdlib, the installed packages' docstrings (repeated documents kept once)")
    p.add_argument("--from-manifest", metavar="MANIFEST",
                   help="build this manifest's corpus again, bit for bit (ignores the options above)")
    p.add_argument("--packages", metavar="DIR",
                   help="with --from-manifest: a folder of wheels and source archives (pip download) to take files "
                        "from; one that does not exist yet is where the error message says to download them")
    p.add_argument("--ignore-installed", action="store_true",
                   help="with --from-manifest: take no file from the installed packages (only from --packages)")
    p.add_argument("--stdlib", metavar="DIR",
                   help="with --from-manifest: the standard library to take files from (default: this Python's)")
    args = p.parse_args(argv)
    if args.valid_every < 1:
        p.error("--valid-every must be at least 1")
    t0 = time.perf_counter()
    if args.from_manifest:
        return _rebuild(args, t0)
    manifest = build_corpus(args.output, default_roots(args.site_packages), args.max_mb, args.valid_every,
                            dedupe=args.site_packages)
    manifest.save(os.path.join(args.output, "manifest.json"))
    source = "stdlib and site-packages" if args.site_packages else "stdlib"
    print(f"demo corpus: {manifest.documents['train']} train + {manifest.documents['valid']} valid documents "
          f"from {len(manifest.files)} files of {source} docstrings in {args.output} "
          f"({time.perf_counter() - t0:.1f}s; pinned by {args.output}/manifest.json)")
    return 0


def _rebuild(args: argparse.Namespace, t0: float) -> int:
    if args.stdlib is not None and not os.path.isdir(args.stdlib):
        print(f"error: --stdlib {args.stdlib} is not a folder", file=sys.stderr)
        return 2
    if args.packages is not None and os.path.exists(args.packages) and not os.path.isdir(args.packages):
        print(f"error: --packages {args.packages} is not a folder", file=sys.stderr)
        return 2
    os.makedirs(args.output, exist_ok=True)
    try:
        manifest = CorpusManifest.load(args.from_manifest)
        outputs = rebuild_from_manifest(manifest, args.output, stdlib_dir=args.stdlib, package_dir=args.packages,
                                        site_dirs=[] if args.ignore_installed else None,
                                        requirements_file=os.path.join(args.output, "missing-packages.txt"))
    except CorpusSourceError as e:
        print(f"error: cannot rebuild the corpus of {args.from_manifest}:\n{e}", file=sys.stderr)
        return 2
    manifest.save(os.path.join(args.output, "manifest.json"))
    if os.path.exists(os.path.join(args.output, "missing-packages.txt")):
        os.remove(os.path.join(args.output, "missing-packages.txt"))
    print(f"rebuilt {args.output} from {args.from_manifest}: {manifest.documents['train']} train + "
          f"{manifest.documents['valid']} valid documents from {len(manifest.files)} files, SHA-256 "
          f"train {outputs['train.jsonl'][:16]}… valid {outputs['valid.jsonl'][:16]}…, as recorded "
          f"({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
