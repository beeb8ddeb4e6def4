"""The committed studies regenerate: every docs/study report.md from its committed pack, by scripts/study/report.py
with the options the report names, and study v5's pilot table and pre-registered analysis by
scripts/study/study_v5.py, byte for byte. A change to the report or the analysis that moves a committed number fails
here; the studies are made again (the commands are in each study's README) and the change says why."""

import re
from pathlib import Path

import pytest

from scripts.study import study_v5
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
V5 = ROOT / "docs" / "study" / "v5"
report = load_script("study/report")


STUDIES = sorted(
    p.parent for p in (ROOT / "docs" / "study").rglob("runs.jsonl.gz") if (p.parent / "report.md").is_file()
)


def test_a_committed_study_has_raw_data():
    assert STUDIES, "no docs/study/<name>/ holds both runs.jsonl.gz and report.md"


@pytest.mark.parametrize("study", STUDIES, ids=[s.relative_to(ROOT / "docs" / "study").as_posix() for s in STUDIES])
def test_committed_report_regenerates_from_committed_data(study, tmp_path):
    """``scripts/study/report.py <pack>`` with the options the report names gives the committed report.md, byte for
    byte, and every plot it links."""
    committed = (study / "report.md").read_text()
    options = re.search(r"^Options: `([^`]*)`", committed, re.M)
    assert options, f"{study / 'report.md'} does not name the options it was made with"
    out = tmp_path / study.name
    assert report.main([str(study / "runs.jsonl.gz"), "--out", str(out), *options.group(1).split()]) == 0
    assert (out / "report.md").read_text() == committed
    for png in re.findall(r"\]\(([^)]+\.png)\)", committed):
        assert (out / png).is_file(), png
        assert (study / png).is_file(), f"{study.name}/report.md links {png}, which is not committed"


GENERATED = [p for p in (V5 / "pilot" / "pilot.md", V5 / "analysis.md") if p.is_file()]


@pytest.mark.parametrize("path", GENERATED, ids=[p.relative_to(V5).as_posix() for p in GENERATED])
def test_committed_study_v5_tables_regenerate_from_the_committed_packs(path):
    """pilot.md's generated block and analysis.md are what scripts/study/study_v5.py makes of the committed packs."""
    committed = path.read_text()
    if path.name == "pilot.md":
        block = committed[committed.index(study_v5.BEGIN) : committed.index(study_v5.END) + len(study_v5.END)]
        assert study_v5.pilot_block(path.parent / "runs.jsonl.gz") == block
    else:
        assert study_v5.analysis(path.parent) == committed


V6 = ROOT / "docs" / "study" / "v6"


@pytest.mark.skipif(not (V6 / "analysis.md").is_file(), reason="study v6's analysis is made once its grid is done")
def test_committed_study_v6_analysis_regenerates_from_the_committed_pack():
    """docs/study/v6/analysis.md is what scripts/study/study_v6.py makes of the committed pack, byte for byte."""
    from scripts.study import study_v6

    assert study_v6.analysis(V6 / "runs.jsonl.gz") == (V6 / "analysis.md").read_text()
