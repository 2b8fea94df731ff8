"""The README and docs/*.md: every relative link resolves, every linked number is in the file it links, and every
cited result file is listed in benchmarks/results/README.md and shipped in the sdist (MANIFEST.in)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"
INLINE = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")  # [text](target)
REF_USE = re.compile(r"\[([^\]]*)\]\[([^\]]+)\]")  # [text][name]
REF_DEF = re.compile(r"^\[([^\]]+)\]:\s*(\S+)", re.M)  # [name]: target
NUMBER = re.compile(r"^\**(-?\d[\d.,]*)\s*(ms|s|GiB|x)?\**$")  # a linked cell such as "98.70 ms"


def links(doc: Path) -> list[tuple[str, str]]:
    """(link text, target) of every inline and reference-style link of ``doc``, targets without their #fragment."""
    text = doc.read_text()
    refs = dict(REF_DEF.findall(text))
    found = INLINE.findall(text) + [(t, refs[name]) for t, name in REF_USE.findall(text) if name in refs]
    return [(t, target.split("#")[0]) for t, target in found if target.split("#")[0]]


def local(target: str) -> bool:
    return not re.match(r"[a-z]+:", target)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_relative_link_resolves(doc):
    broken = [target for _, target in links(doc) if local(target) and not (doc.parent / target).exists()]
    assert not broken, f"{doc.name} links files that are not there: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_a_linked_number_is_in_the_file_it_links(doc):
    wrong = []
    for text, target in links(doc):
        number = NUMBER.match(text.strip())
        if number and local(target) and RESULTS in (doc.parent / target).resolve().parents:
            exact = rf"(?<![\d.]){re.escape(number.group(1))}(?![\d])"  # 98.7 is not 98.70's start
            if not re.search(exact, (doc.parent / target).read_text()):
                wrong.append((text, target))
    assert not wrong, f"{doc.name}: these numbers are not in the files their links name: {wrong}"


def cited_results() -> set[str]:
    return {
        (doc.parent / target).resolve().name
        for doc in DOCS
        for _, target in links(doc)
        if local(target) and RESULTS in (doc.parent / target).resolve().parents
    }


def test_the_readme_table_links_its_result_file():
    assert "2026-11-26_nvidia-h100-80gb-hbm3_model-8b-after-dcd3d24.md" in cited_results()


def test_the_results_index_lists_every_cited_file():
    index = (RESULTS / "README.md").read_text()
    missing = sorted(name for name in cited_results() if f"]({name})" not in index)
    assert not missing, f"benchmarks/results/README.md does not list {missing}"


def test_the_sdist_ships_every_cited_result_file():
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "recursive-include benchmarks/results *.md *.txt" in manifest
    missing = sorted(
        name
        for name in cited_results()
        if Path(name).suffix not in (".md", ".txt") and f"include benchmarks/results/{name}" not in manifest
    )
    assert not missing, f"MANIFEST.in leaves out cited result files {missing}"
