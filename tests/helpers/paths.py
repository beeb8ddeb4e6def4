"""Where the repository's files are, for tests in any tier."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets" / "tiny-math"
SHARED_DATA = ROOT.parent / "shared" / "data"
