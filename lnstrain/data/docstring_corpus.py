"""The docstring corpus: real English-and-code text from Python sources, and the manifest that pins it.

A corpus is built by walking Python source roots in a fixed order (the standard library, then, when
asked, the installed packages), parsing each ``.py`` file with ``ast`` (never importing it) and taking
its docstrings: a module's own docstring is one document, each top-level class or function (its
docstring followed by those of everything inside it) another. Every ``valid_every``-th document goes to
``valid.jsonl``, the rest to ``train.jsonl``; with ``dedupe`` a document seen before is skipped.

What such a corpus holds depends on the files that happened to be installed, so every build also
writes a *manifest*: the interpreter's version, each file that gave at least one document (its root,
its path under that root, the distribution and version that installed it, and the SHA-256 of its
bytes), in walk order, and the SHA-256 of both outputs. Files that gave nothing are left out: skipping
them changes nothing. ``rebuild_from_manifest`` makes the same corpus elsewhere, bit for bit, taking
each file from wherever its bytes are found (this interpreter's standard library, an installed package,
a CPython ``Lib/`` folder, or a wheel or source archive of the recorded version in a folder), and
refusing, with the ``pip download`` lines that would fix it, when some are not.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import platform
import re
import sysconfig
import tarfile
import zipfile
from collections.abc import Callable, Iterable, Iterator

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
MANIFEST_KIND = "lnstrain docstring corpus"
STDLIB, SITE = "stdlib", "site"
STDLIB_SOURCE = "<stdlib>"
UNOWNED_SOURCE = "<unowned>"
SKIPPED_DIRS = ("test", "tests", "idlelib", "__pycache__")
OUTPUTS = ("train.jsonl", "valid.jsonl")


class CorpusSourceError(ValueError):
    """A manifest's corpus cannot be rebuilt here (the message says what is missing and how to get it)."""


@dataclasses.dataclass(frozen=True)
class CorpusFile:
    """One source file that gave documents: where it lives, who installed it, and its bytes' SHA-256."""

    root: str          # STDLIB or SITE
    path: str          # relative to its root, with "/" separators
    source: int        # index into CorpusManifest.sources
    sha256: str


@dataclasses.dataclass
class CorpusManifest:
    """What a docstring corpus was built from, enough to build it again (see the module docstring)."""

    python: str
    valid_every: int
    dedupe: bool
    max_mb: float
    sources: list[tuple[str, str]]            # (distribution name, version); index 0 is the stdlib
    files: list[CorpusFile]
    documents: dict[str, int]                 # {"train": n, "valid": n}
    outputs: dict[str, str]                   # {"train.jsonl": sha256, "valid.jsonl": sha256}

    def to_json(self) -> dict:
        return {"format": MANIFEST_FORMAT, "kind": MANIFEST_KIND, "python": self.python,
                "valid_every": self.valid_every, "dedupe": self.dedupe, "max_mb": self.max_mb,
                "sources": [list(s) for s in self.sources],
                "files": [[f.root, f.path, f.source, f.sha256] for f in self.files],
                "documents": self.documents, "outputs": self.outputs}

    @classmethod
    def from_json(cls, data: dict) -> CorpusManifest:
        if not isinstance(data, dict) or data.get("kind") != MANIFEST_KIND:
            raise CorpusSourceError("not a docstring-corpus manifest (no \"kind\": "
                                    f"\"{MANIFEST_KIND}\"); tools/make_demo_corpus.py writes one beside each corpus")
        if data.get("format") != MANIFEST_FORMAT:
            raise CorpusSourceError(f"manifest format {data.get('format')!r} is not {MANIFEST_FORMAT}, the one "
                                    "this lnstrain reads")
        try:
            sources = [(str(name), str(version)) for name, version in data["sources"]]
            files = [CorpusFile(str(root), str(path), int(source), str(sha))
                     for root, path, source, sha in data["files"]]
            manifest = cls(python=str(data["python"]), valid_every=int(data["valid_every"]),
                           dedupe=bool(data["dedupe"]), max_mb=float(data["max_mb"]), sources=sources,
                           files=files, documents={k: int(v) for k, v in data["documents"].items()},
                           outputs={k: str(v) for k, v in data["outputs"].items()})
        except (KeyError, TypeError, ValueError) as e:
            raise CorpusSourceError(f"the manifest is malformed ({type(e).__name__}: {e})") from None
        for f in manifest.files:
            if f.root not in (STDLIB, SITE) or not 0 <= f.source < len(sources) or _unsafe(f.path):
                raise CorpusSourceError(f"the manifest names an impossible file {f.root}:{f.path!r}")
        if set(manifest.outputs) != set(OUTPUTS):
            raise CorpusSourceError(f"the manifest's outputs must be exactly {', '.join(OUTPUTS)}")
        return manifest

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> CorpusManifest:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise CorpusSourceError(f"cannot read the manifest {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise CorpusSourceError(f"the manifest {path} is not JSON ({e})") from None
        return cls.from_json(data)


def _unsafe(path: str) -> bool:
    return path.startswith("/") or "\\" in path or any(part in ("", ".", "..") for part in path.split("/"))


def module_documents(source: bytes) -> list[str]:
    """Documents of one module's source: its own docstring, then one per top-level class or function."""
    try:
        text = io.TextIOWrapper(io.BytesIO(source), encoding="utf-8").read()
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
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


def _docstrings(node: ast.AST) -> list[str]:
    docs = []
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(sub)
            if doc and len(doc) >= 40 and doc not in docs:
                docs.append(doc)
    return docs


def python_files(root: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The ``.py`` files under ``root`` (paths relative to it, "/"-separated), in the corpus's walk order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip + SKIPPED_DIRS)
        rel = os.path.relpath(dirpath, root)
        files += [f if rel == "." else f"{rel}/{f}".replace(os.sep, "/") for f in sorted(filenames)
                  if f.endswith(".py")]
    return sorted(files)


def default_roots(site_packages: bool) -> list[tuple[str, str]]:
    """This interpreter's (root kind, folder) pairs: the stdlib, then (if asked) the installed packages."""
    paths = sysconfig.get_paths()
    roots = [(STDLIB, paths["stdlib"])]
    return roots + [(SITE, paths["purelib"])] if site_packages else roots


def installed_owners(site_dir: str) -> dict[str, tuple[str, str]]:
    """Path under ``site_dir`` -> (distribution, version), from the installed packages' RECORD files."""
    owners: dict[str, tuple[str, str]] = {}
    for dist in importlib.metadata.distributions(path=[site_dir]):
        name, version = dist.metadata["Name"], dist.version
        for f in dist.files or ():
            owners.setdefault(str(f).replace(os.sep, "/"), (name, version))
    return owners


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


class _CorpusWriter:
    """Writes documents to train/valid under temporary names; ``finish`` hashes and renames them."""

    def __init__(self, output_dir: str, valid_every: int, dedupe: bool):
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir, self.valid_every, self.dedupe = output_dir, valid_every, dedupe
        self.tmp = {name: open(os.path.join(output_dir, f".{name}.{os.getpid()}.partial"), "wb")
                    for name in OUTPUTS}
        self.hashes = {name: hashlib.sha256() for name in OUTPUTS}
        self.counts = {"train": 0, "valid": 0}
        self.nbytes, self.seen, self.n = 0, set(), 0

    def add(self, docs: Iterable[str]) -> int:
        """Adds one file's documents; returns how many it gave (after dedupe)."""
        given = 0
        for text in docs:
            if self.dedupe:
                if text in self.seen:
                    continue
                self.seen.add(text)
            self.n += 1
            split = "valid" if self.n % self.valid_every == 0 else "train"
            line = (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8")
            self.tmp[f"{split}.jsonl"].write(line)
            self.hashes[f"{split}.jsonl"].update(line)
            self.counts[split] += 1
            self.nbytes += len(text.encode("utf-8"))
            given += 1
        return given

    def finish(self, expected: dict[str, str] | None = None) -> dict[str, str]:
        digests = {name: h.hexdigest() for name, h in self.hashes.items()}
        for f in self.tmp.values():
            f.close()
        if expected is not None and digests != expected:
            self.discard()
            wrong = ", ".join(f"{n} {digests[n][:12]}… (the manifest says {expected.get(n, '?')[:12]}…)"
                              for n in OUTPUTS if digests[n] != expected.get(n))
            raise CorpusSourceError(
                f"every source file matched its hash, yet the corpus differs: {wrong}. The documents are "
                "read with this interpreter's ast; run on the Python the manifest names")
        for name, f in self.tmp.items():
            os.replace(f.name, os.path.join(self.output_dir, name))
        return digests

    def discard(self) -> None:
        for f in self.tmp.values():
            f.close()
            if os.path.exists(f.name):
                os.unlink(f.name)


def build_corpus(output_dir: str, roots: list[tuple[str, str]], max_mb: float, valid_every: int = 20,
                 dedupe: bool = False) -> CorpusManifest:
    """Builds the corpus from ``roots`` ((kind, folder) pairs, walked in order) and returns its manifest.

    Stops after the file that brings the text past ``max_mb`` megabytes. The manifest is not saved
    here; callers write it beside the corpus (``manifest.json``).
    """
    writer = _CorpusWriter(output_dir, valid_every, dedupe)
    sources: list[tuple[str, str]] = [(STDLIB_SOURCE, platform.python_version())]
    source_index = {sources[0]: 0}
    files: list[CorpusFile] = []
    try:
        for kind, folder in roots:
            owners = installed_owners(folder) if kind == SITE else {}
            skip = ("site-packages", "dist-packages") if kind == STDLIB else ()
            for rel in python_files(folder, skip):
                data = _read(os.path.join(folder, rel))
                if data is None or not writer.add(module_documents(data)):
                    continue
                owner = sources[0] if kind == STDLIB else owners.get(rel, (UNOWNED_SOURCE, ""))
                if owner not in source_index:
                    source_index[owner] = len(sources)
                    sources.append(owner)
                files.append(CorpusFile(kind, rel, source_index[owner], _sha256(data)))
                if writer.nbytes >= max_mb * 1e6:
                    break
            if writer.nbytes >= max_mb * 1e6:
                break
        outputs = writer.finish()
    except BaseException:
        writer.discard()
        raise
    logger.info("docstring corpus: %d train + %d valid documents, %.2f MB from %d files of %d sources",
                writer.counts["train"], writer.counts["valid"], writer.nbytes / 1e6, len(files), len(sources))
    return CorpusManifest(python=platform.python_version(), valid_every=valid_every, dedupe=dedupe,
                          max_mb=max_mb, sources=sources, files=files, documents=dict(writer.counts),
                          outputs=outputs)


def normalized_name(name: str) -> str:
    """A distribution name as wheel file names and indexes compare it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


class PackageFolder:
    """The wheels and source archives in a folder, by (normalized name, version), read without installing.

    A wheel's members sit where pip would install them (or under ``*.data/purelib|platlib``); a source
    archive's (``.tar.gz``, ``.zip``: some packages publish no wheel) under its top folder or its
    ``src/``. Which one holds a file's recorded bytes is decided by its hash, never by trust.
    """

    SDIST_SUFFIXES = (".tar.gz", ".zip")

    def __init__(self, folder: str | None):
        self.archives: dict[tuple[str, str], list[str]] = {}
        self._members: dict[str, dict[str, bytes]] = {}
        if folder is None or not os.path.isdir(folder):
            return
        for entry in sorted(os.listdir(folder)):
            key = self._name_and_version(entry)
            if key is not None:
                self.archives.setdefault(key, []).append(os.path.join(folder, entry))

    @classmethod
    def _name_and_version(cls, entry: str) -> tuple[str, str] | None:
        if entry.endswith(".whl"):
            parts = entry[:-len(".whl")].split("-")
            return (normalized_name(parts[0]), parts[1]) if len(parts) in (5, 6) else None
        for suffix in cls.SDIST_SUFFIXES:
            if entry.endswith(suffix) and "-" in entry:
                name, version = entry[:-len(suffix)].rsplit("-", 1)
                return normalized_name(name), version
        return None

    def readers(self, name: str, version: str) -> list[Callable[[str], bytes | None]]:
        """For each archive of ``name`` ``version``: a reader of a site-packages path from it (or None)."""
        return [lambda rel, path=path: self._python_members(path).get(rel)
                for path in self.archives.get((normalized_name(name), version), [])]

    def _python_members(self, archive: str) -> dict[str, bytes]:
        """Every ``.py`` member of ``archive``, keyed by the site-packages path it installs to."""
        if archive not in self._members:
            members: dict[str, bytes] = {}
            try:
                if archive.endswith(".tar.gz"):
                    with tarfile.open(archive, "r:gz") as tar:
                        for info in tar:
                            if info.isfile() and info.name.endswith(".py"):
                                data = tar.extractfile(info)
                                if data is not None:
                                    self._add(members, info.name, data.read(), sdist=True)
                else:
                    with zipfile.ZipFile(archive) as zf:
                        for name in zf.namelist():
                            if name.endswith(".py"):
                                self._add(members, name, zf.read(name), sdist=not archive.endswith(".whl"))
            except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError) as e:
                logger.warning("skipping %s: not a readable archive (%s)", archive, e)
            self._members[archive] = members
        return self._members[archive]

    @staticmethod
    def _add(members: dict[str, bytes], name: str, data: bytes, sdist: bool) -> None:
        parts = name.split("/")
        if sdist:
            parts = parts[1:]                       # the archive's top folder, name-version/
            if parts[:1] == ["src"]:
                parts = parts[1:]
        elif len(parts) > 2 and parts[0].endswith(".data") and parts[1] in ("purelib", "platlib"):
            parts = parts[2:]
        if parts:
            members.setdefault("/".join(parts), data)

    def close(self) -> None:
        self._members.clear()


def rebuild_from_manifest(manifest: CorpusManifest, output_dir: str, stdlib_dir: str | None = None,
                          site_dirs: list[str] | None = None, package_dir: str | None = None,
                          requirements_file: str | None = None) -> dict[str, str]:
    """Builds ``manifest``'s corpus in ``output_dir`` and checks it is the same, byte for byte.

    Each file is taken from the first place whose bytes have the recorded SHA-256: for the stdlib,
    ``stdlib_dir`` (default: this interpreter's); for packages, ``site_dirs`` (default: this
    interpreter's site-packages), then the wheels or source archives of the recorded version in
    ``package_dir``. Raises ``CorpusSourceError`` before writing the corpus when some file is nowhere,
    naming each missing distribution and the ``pip download`` line that fetches it (one line for all
    of them, reading ``requirements_file``, when that is given: the missing pins are written there).
    """
    paths = sysconfig.get_paths()
    stdlib_dir = stdlib_dir or paths["stdlib"]
    site_dirs = site_dirs if site_dirs is not None else [paths["purelib"]]
    packages = PackageFolder(package_dir)
    try:
        readers, missing = [], {}
        for f in manifest.files:
            read = _find(f, manifest, stdlib_dir, site_dirs, packages)
            if read is None:
                missing.setdefault(f.source, []).append(f.path)
            readers.append(read)
        if missing:
            raise CorpusSourceError(_missing_message(manifest, missing, stdlib_dir, package_dir, requirements_file))
        writer = _CorpusWriter(output_dir, manifest.valid_every, manifest.dedupe)
        try:
            for f, read in zip(manifest.files, readers):
                data = read(f.path)  # vouched for above; the outputs' hashes catch a file changed since
                if data is None:
                    raise CorpusSourceError(f"{f.root}:{f.path} vanished while the corpus was being built")
                writer.add(module_documents(data))
            return writer.finish(expected=manifest.outputs)
        except BaseException:
            writer.discard()
            raise
    finally:
        packages.close()


def _find(f: CorpusFile, manifest: CorpusManifest, stdlib_dir: str, site_dirs: list[str],
          packages: PackageFolder) -> Callable[[str], bytes | None] | None:
    """The first reader that gives ``f``'s recorded bytes, or None."""
    readers: list[Callable[[str], bytes | None]]
    if f.root == STDLIB:
        readers = [lambda rel: _read(os.path.join(stdlib_dir, rel))]
    else:
        readers = [lambda rel, d=d: _read(os.path.join(d, rel)) for d in site_dirs]
        readers += packages.readers(*manifest.sources[f.source])
    for read in readers:
        data = read(f.path)
        if data is not None and _sha256(data) == f.sha256:
            return read
    return None


def _missing_message(manifest: CorpusManifest, missing: dict[int, list[str]], stdlib_dir: str,
                     package_dir: str | None, requirements_file: str | None) -> str:
    total = sum(len(v) for v in missing.values())
    folder = package_dir or "PACKAGES"
    lines = [f"{total} of the corpus's {len(manifest.files)} source files are not here with the bytes it was "
             f"built from ({len(missing)} source(s)):"]
    downloads = []
    for index in sorted(missing):
        name, version = manifest.sources[index]
        n = len(missing[index])
        if name == STDLIB_SOURCE:
            lines.append(f"  the standard library, {n} file(s) (first: {missing[index][0]}): the corpus was built on "
                         f"Python {version}; run on it, or pass --stdlib with CPython {version}'s Lib/ folder "
                         f"(this one: {stdlib_dir})")
        elif name == UNOWNED_SOURCE:
            lines.append(f"  {n} file(s) no installed distribution owned (first: {missing[index][0]}): only a "
                         "copy of the machine that built the corpus has them")
        else:
            lines.append(f"  {name} {version}, {n} file(s) (first: {missing[index][0]})")
            downloads.append(f"{name}=={version}")
    if downloads:
        lines.append(f"Fetch them into {folder} (nothing is installed; a package with no wheel comes as its source "
                     f"archive), then run again with --packages {folder}:")
        if requirements_file is not None:
            with open(requirements_file, "w", encoding="utf-8") as f:
                f.write("".join(f"{d}\n" for d in downloads))
            lines.append(f"  pip download --no-deps -r {requirements_file} -d {folder}")
        else:
            lines += [f"  pip download --no-deps '{d}' -d {folder}" for d in downloads]
    return "\n".join(lines)
