"""A run folder's metrics.jsonl as rows, and the rows without what differs between any two runs."""

import json
from pathlib import Path

# Wall-clock and throughput differ between any two runs; everything else must not.
TIMING = ("time/", "reward/verify_s", "rollout/tokens_per_s", "buffer/consumer_wait_s", "buffer/producer_wait_s")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def untimed(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rs]
