"""The docstring corpus's manifest: it pins the files a corpus came from, and rebuilds it bit for bit."""
from __future__ import annotations

import hashlib
import json
import os
import zipfile

import pytest

from lnstrain.data.docstring_corpus import (
    SITE,
    STDLIB,
    STDLIB_SOURCE,
    UNOWNED_SOURCE,
    CorpusManifest,
    CorpusSourceError,
    build_corpus,
    rebuild_from_manifest,
)
from tests.tool_scripts import load_tool

LONG = "This sentence is long enough to be kept as a document by the corpus builder."


def _module(name: str, extra: str = "") -> str:
    return (f'"""Module {name}. {LONG}"""\n\n'
            f'def {name}_function():\n    """The function of {name}. {LONG} {extra}"""\n\n'
            'def short():\n    """Too short."""\n')


def _write(root, rel: str, text: str) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


@pytest.fixture
def roots(tmp_path):
    """A fake stdlib and site-packages: one owned package (pkg 1.0), one unowned module, skipped folders."""
    stdlib, site = tmp_path / "stdlib", tmp_path / "site"
    _write(stdlib, "alpha.py", _module("alpha"))
    _write(stdlib, "beta/gamma.py", _module("gamma"))
    _write(stdlib, "only_short.py", '"""Short."""\n')
    _write(stdlib, "test/test_alpha.py", _module("skipped_test"))
    _write(stdlib, "site-packages/inside.py", _module("skipped_site"))
    _write(site, "pkg/__init__.py", _module("pkg") + _module("alpha"))   # alpha's documents repeat
    _write(site, "pkg/core.py", _module("core"))
    _write(site, "loose.py", _module("loose"))
    _write(site, "pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n")
    _write(site, "pkg-1.0.dist-info/RECORD", "pkg/__init__.py,,\npkg/core.py,,\npkg-1.0.dist-info/METADATA,,\n")
    return str(stdlib), str(site)


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _corpus(folder) -> dict[str, bytes]:
    out = {}
    for name in ("train.jsonl", "valid.jsonl"):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def _build(roots, out, max_mb=10.0):
    stdlib, site = roots
    return build_corpus(str(out), [(STDLIB, stdlib), (SITE, site)], max_mb, valid_every=3, dedupe=True)


def test_the_manifest_pins_every_file_that_gave_a_document_in_walk_order(roots, tmp_path):
    manifest = _build(roots, tmp_path / "corpus")
    assert [(f.root, f.path) for f in manifest.files] == [
        (STDLIB, "alpha.py"), (STDLIB, "beta/gamma.py"), (SITE, "loose.py"), (SITE, "pkg/__init__.py"),
        (SITE, "pkg/core.py")]
    by_path = {f.path: manifest.sources[f.source] for f in manifest.files}
    assert by_path["alpha.py"][0] == STDLIB_SOURCE
    assert by_path["pkg/__init__.py"] == by_path["pkg/core.py"] == ("pkg", "1.0")
    assert by_path["loose.py"] == (UNOWNED_SOURCE, "")
    for f in manifest.files:
        assert f.sha256 == _sha(os.path.join(roots[0] if f.root == STDLIB else roots[1], f.path))
    assert manifest.outputs == {name: _sha(tmp_path / "corpus" / name) for name in ("train.jsonl", "valid.jsonl")}
    texts = [json.loads(line)["text"] for name in ("train.jsonl", "valid.jsonl")
             for line in (tmp_path / "corpus" / name).read_text(encoding="utf-8").splitlines()]
    assert len(texts) == len(set(texts)) == sum(manifest.documents.values()) == 10
    assert not any("skipped" in t for t in texts)


def test_a_manifest_rebuilds_its_corpus_bit_for_bit_taking_changed_files_from_a_wheel(roots, tmp_path):
    stdlib, site = roots
    manifest = _build(roots, tmp_path / "corpus")
    manifest.save(str(tmp_path / "manifest.json"))
    expected = _corpus(tmp_path / "corpus")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "pkg-1.0-py3-none-any.whl", "w") as whl:
        for rel in ("pkg/__init__.py", "pkg/core.py"):
            whl.write(os.path.join(site, rel), rel)
    _write(site, "pkg/core.py", _module("core", extra="Changed by an upgrade."))

    out = tmp_path / "rebuilt"
    out.mkdir()
    (out / "train.jsonl").write_text("the previous corpus\n")
    loaded = CorpusManifest.load(str(tmp_path / "manifest.json"))
    with pytest.raises(CorpusSourceError) as failure:
        rebuild_from_manifest(loaded, str(out), stdlib_dir=stdlib, site_dirs=[site])
    message = str(failure.value)
    assert "pkg 1.0, 1 file(s) (first: pkg/core.py)" in message
    assert "pip download --no-deps 'pkg==1.0'" in message
    assert (out / "train.jsonl").read_text() == "the previous corpus\n"
    assert sorted(os.listdir(out)) == ["train.jsonl"]
    pins = tmp_path / "missing.txt"
    with pytest.raises(CorpusSourceError, match=f"pip download --no-deps -r {pins}"):
        rebuild_from_manifest(loaded, str(out), stdlib_dir=stdlib, site_dirs=[site], requirements_file=str(pins))
    assert pins.read_text() == "pkg==1.0\n"

    digests = rebuild_from_manifest(loaded, str(out), stdlib_dir=stdlib, site_dirs=[site], package_dir=str(wheels))
    assert _corpus(out) == expected
    assert digests == manifest.outputs


def test_the_standard_library_can_come_from_another_folder_and_a_missing_one_is_named(roots, tmp_path):
    stdlib, site = roots
    manifest = _build(roots, tmp_path / "corpus")
    copy = tmp_path / "cpython_lib"
    for rel in ("alpha.py", "beta/gamma.py"):
        with open(os.path.join(stdlib, rel), encoding="utf-8") as f:
            _write(copy, rel, f.read())
    _write(stdlib, "alpha.py", _module("alpha", extra="Another Python's version."))
    with pytest.raises(CorpusSourceError, match=r"the standard library, 1 file\(s\) \(first: alpha.py\).*"
                                                r"--stdlib"):
        rebuild_from_manifest(manifest, str(tmp_path / "out"), stdlib_dir=stdlib, site_dirs=[site])
    rebuild_from_manifest(manifest, str(tmp_path / "out"), stdlib_dir=str(copy), site_dirs=[site])
    assert _corpus(tmp_path / "out") == _corpus(tmp_path / "corpus")


def test_a_size_cap_stops_after_the_file_that_crosses_it_and_the_rebuild_keeps_that_stop(roots, tmp_path):
    stdlib, site = roots
    full = _build(roots, tmp_path / "full")
    capped = _build(roots, tmp_path / "capped", max_mb=1e-6)
    assert [f.path for f in capped.files] == ["alpha.py"] and len(full.files) == 5
    rebuild_from_manifest(capped, str(tmp_path / "again"), stdlib_dir=stdlib, site_dirs=[site])
    assert _corpus(tmp_path / "again") == _corpus(tmp_path / "capped")


def test_a_rebuild_whose_documents_differ_is_refused_and_leaves_nothing(roots, tmp_path):
    stdlib, site = roots
    manifest = _build(roots, tmp_path / "corpus")
    manifest.outputs["valid.jsonl"] = "0" * 64
    with pytest.raises(CorpusSourceError, match="yet the corpus differs: valid.jsonl"):
        rebuild_from_manifest(manifest, str(tmp_path / "out"), stdlib_dir=stdlib, site_dirs=[site])
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["files"].__setitem__(0, ["stdlib", "../etc/passwd.py", 0, "0" * 64]), "impossible file"),
    (lambda m: m["files"].__setitem__(0, ["elsewhere", "alpha.py", 0, "0" * 64]), "impossible file"),
    (lambda m: m.__setitem__("format", 9), "format 9"),
    (lambda m: m.pop("outputs"), "malformed"),
    (lambda m: m.__setitem__("kind", "something else"), "not a docstring-corpus manifest"),
])
def test_a_bad_manifest_is_refused_by_the_cli_with_exit_2_and_no_traceback(roots, tmp_path, capsys, edit, needle):
    _build(roots, tmp_path / "corpus").save(str(tmp_path / "manifest.json"))
    data = json.loads((tmp_path / "manifest.json").read_text())
    edit(data)
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    tool = load_tool("make_demo_corpus")
    assert tool.main(["--output", str(tmp_path / "out"), "--from-manifest", str(tmp_path / "manifest.json")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_the_cli_pins_a_real_stdlib_corpus_and_rebuilds_it_and_names_what_another_python_lacks(tmp_path, capsys):
    tool = load_tool("make_demo_corpus")
    assert tool.main(["--output", str(tmp_path / "corpus"), "--max-mb", "0.2"]) == 0
    manifest = str(tmp_path / "corpus" / "manifest.json")
    assert tool.main(["--output", str(tmp_path / "again"), "--from-manifest", manifest]) == 0
    assert _corpus(tmp_path / "again") == _corpus(tmp_path / "corpus")

    (tmp_path / "empty_lib").mkdir()
    assert tool.main(["--output", str(tmp_path / "elsewhere"), "--from-manifest", manifest,
                      "--stdlib", str(tmp_path / "empty_lib")]) == 2
    err = capsys.readouterr().err
    assert "the standard library" in err and "Traceback" not in err
    assert not (tmp_path / "elsewhere" / "train.jsonl").exists()


def test_a_package_with_no_wheel_is_read_from_its_source_archive(roots, tmp_path):
    import tarfile

    stdlib, site = roots
    manifest = _build(roots, tmp_path / "corpus")
    archives = tmp_path / "packages"
    archives.mkdir()
    with tarfile.open(archives / "pkg-1.0.tar.gz", "w:gz") as tar:
        for rel in ("pkg/__init__.py", "pkg/core.py"):
            tar.add(os.path.join(site, rel), f"pkg-1.0/src/{rel}")
        tar.add(os.path.join(site, "loose.py"), "pkg-1.0/setup.py")
    os.remove(os.path.join(site, "pkg/__init__.py"))
    rebuild_from_manifest(manifest, str(tmp_path / "out"), stdlib_dir=stdlib, site_dirs=[site],
                          package_dir=str(archives))
    assert _corpus(tmp_path / "out") == _corpus(tmp_path / "corpus")


def test_the_cli_names_the_missing_packages_and_the_folder_to_fetch_them_into(roots, tmp_path, capsys):
    stdlib, _ = roots
    _build(roots, tmp_path / "corpus").save(str(tmp_path / "manifest.json"))
    fetch_into = tmp_path / "not_yet_downloaded"
    tool = load_tool("make_demo_corpus")
    assert tool.main(["--output", str(tmp_path / "out"), "--from-manifest", str(tmp_path / "manifest.json"),
                      "--stdlib", stdlib, "--packages", str(fetch_into)]) == 2
    err = capsys.readouterr().err
    pins = tmp_path / "out" / "missing-packages.txt"
    assert f"pip download --no-deps -r {pins} -d {fetch_into}" in err
    assert "1 file(s) no installed distribution owned (first: loose.py)" in err
    assert pins.read_text() == "pkg==1.0\n" and "Traceback" not in err
    (tmp_path / "a_file").write_text("")
    assert tool.main(["--output", str(tmp_path / "out"), "--from-manifest", str(tmp_path / "manifest.json"),
                      "--packages", str(tmp_path / "a_file")]) == 2
    assert "--packages" in capsys.readouterr().err
