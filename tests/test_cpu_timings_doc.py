"""One place holds the CPU timings: docs/benchmarks.md, "Set-up and tests on a CPU", quoting the log that
``scripts/cpu_timings.sh`` wrote. Its times and test counts are the log's; the README and scripts/test.sh point to it
and quote no timing of their own."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Set-up and tests on a CPU"
TIME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?) ?(?:s|seconds|min|minutes)\b|\d+m\d+(?:\.\d+)?s")


def section() -> str:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert HEADING in text, f"docs/benchmarks.md has no section {HEADING!r}"
    return text.split(HEADING + "\n", 1)[1].split("\n## ", 1)[0]


def cited_log() -> Path:
    logs = re.findall(r"\((\.\./benchmarks/results/[^)]*_cpu_setup-and-tests\.txt)\)", section())
    assert len(logs) == 1, f"the section should link one log, got {logs}"
    path = (ROOT / "docs" / logs[0]).resolve()
    assert path.is_file(), f"{logs[0]}: no such file"
    return path


def test_the_section_quotes_its_log():
    log = cited_log().read_text()
    rows = [line for line in section().splitlines() if line.startswith("| ") and not line.startswith("| what")]
    quoted = [float(re.search(r"\| ([\d.]+) s \|\s*$", row).group(1)) for row in rows]
    assert quoted == [float(t) for t in re.findall(r"^real ([\d.]+) s$", log, re.M)], "the times are not the log's"
    passed = [int(n) for row in rows for n in re.findall(r"(\d+) passed", row)]
    assert passed == [int(n) for n in re.findall(r"^(?:=+ )?(\d+) passed", log, re.M)], "the counts are not the log's"
    commit = re.search(r"^commit: ([0-9a-f]{40}) \(uncommitted changes: (?:yes|no)\)$", log, re.M)
    assert commit, "the log names no commit"
    assert commit.group(1)[:12] in section(), "the section names another commit than its log"


def test_the_readme_and_test_sh_point_to_that_place_and_quote_no_timing():
    readme = (ROOT / "README.md").read_text()
    clone = readme.split("## From a clone", 1)[1].split("\n## ", 1)[0]
    assert "docs/benchmarks.md#set-up-and-tests-on-a-cpu" in clone
    assert not TIME.search(clone), f"the README quotes a timing of its own: {TIME.search(clone).group(0)}"
    header = "".join(line for line in (ROOT / "scripts" / "test.sh").read_text().splitlines(True) if line[0] == "#")
    assert 'docs/benchmarks.md, "Set-up and tests on a CPU"' in header
    assert not TIME.search(header), f"scripts/test.sh's header quotes a timing: {TIME.search(header).group(0)}"
    usage = (ROOT / "docs" / "usage.md").read_text()
    assert "setup-and-tests.txt" not in usage and "benchmarks.md#set-up-and-tests-on-a-cpu" in usage
