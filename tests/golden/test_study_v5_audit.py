"""docs/study/v5/audit.md is what scripts/study/study_v5_audit.py makes of study v5's committed packs, byte for byte:
docs/study/README.md quotes its figures, so a change that moves one fails here and the prose is read again."""

from pathlib import Path

from scripts.study import study_v5_audit

V5 = Path(__file__).resolve().parents[2] / "docs" / "study" / "v5"


def test_committed_study_v5_audit_regenerates_from_the_committed_packs():
    assert study_v5_audit.audit(V5) == (V5 / "audit.md").read_text()
