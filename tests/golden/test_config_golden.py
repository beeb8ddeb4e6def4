"""Every shipped config composes to the values it had when tests/golden/composed_configs.txt was recorded.

A refactor of the config (schemas beside their stages, YAML bases per group, renamed keys) must not change
what a run computes. The recording holds the resolved composition of the default config, of every option of
every group, of every experiment and of eval.py's config; this test composes each again and compares key by
key. A key that a refactor renames is listed in ``RENAMED`` (old -> new), a key it adds with the value the old
code used implicitly in ``ADDED``, a key it drops (a knob that did nothing) in ``DROPPED``: each with its reason,
so the diff a reviewer reads is exactly the list of what moved.

The file is for review: one key a line, the default config in full and every other composition as its
differences from the default (``key = <json>``, or ``key -`` for a key it does not have), so a changed default
is one line and a changed option is the lines of that option. It guards the compositions it holds: a new option
(a new YAML file) is recorded when its YAML is reviewed, not a failure. Regenerate when a change is meant to move
values, or to record a new option: ``python tests/golden/test_config_golden.py --record``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "composed_configs.txt"
DATA_DIR = "/data"  # paths.data_dir, fixed so the recording does not depend on the machine

RENAMED: dict[str, str] = {  # old flattened key -> new flattened key
    # The worker processes' count is the disaggregated placement's key (bapo/rollout/disaggregated/placement.py),
    # not one of the schema every engine shares: only that placement reads it. Same value, same run.
    "rollout.workers": "placement.workers",
}
ADDED: dict[str, object] = {
    # The objective's registered name (bapo.algos.objective): the loop's branch on algo.eps_feedback before.
    "algo.objective": "surrogate",
    # The clipped surrogate's options now compose for every surrogate algorithm from conf/algo/base/
    # surrogate.yaml (a rival states only what it changes); a group without them meant exactly these (PPO's clip).
    "algo.surrogate.ratio_level": "token",
    "algo.surrogate.is_weight": "clip",
    "algo.surrogate.positive_weight": "ratio",
    "algo.surrogate.token_mask": "none",
    "algo.surrogate.mask_threshold": None,
    # Partial rollouts (bapo/rollout/maker.py): off, every response generated whole, as before.
    "rollout.partial_budget": None,
    # The learner's torch threads (placement.learner_threads): torch's default, as before.
    "placement.learner_threads": None,
    # Time-based checkpoints (bapo/loop.py SaveClock): off, as before.
    "checkpoint.every_minutes": 0,
    # The grace the plain launch gives its ranks after a stop (bapo/entry/launch.py start): torch's was 30 s.
    "launcher.grace_s": 120,
    # rollout=vllm_server's admission (bapo/engines/admission.py): requests in flight fill the server's KV cache at
    # their expected length; before, each request reserved its whole budget, with no key (generation speed only).
    "rollout.kv_overcommit": 1.0,
}
# Per composition, where an added key's value differs from ADDED's.
ADDED_IN: dict[str, dict[str, object]] = {"algo=eps_feedback": {"algo.objective": "eps_feedback"}}
DROPPED: set[str] = set()  # old flattened keys that no longer exist
# (key, recorded value) -> the value that now says the same: "no clip" is null, not a bound no ratio reaches
# (a ratio is never below 0, and the loss clamps it at e^20 ~ 4.9e8 < 1e9), so the loss is the same.
RESTATED: dict[tuple[str, object], object] = {
    ("algo.bounds.ratio_low", 0.0): None,
    ("algo.bounds.ratio_high", 1.0e9): None,
}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))


def compositions() -> dict[str, tuple[str, list[str]]]:
    """name -> (config name, overrides): everything a user can pick by one option, and the documented mixes."""
    out: dict[str, tuple[str, list[str]]] = {"default": ("config", [])}
    for group in ("algo", "model", "data", "rollout", "buffer", "learner", "logger", "placement", "experiment"):
        for opt in _options(group):
            out[f"{group}={opt}"] = ("config", [f"{group}={opt}"])
    for sub in ("bounds", "correction"):
        for opt in _options(f"algo/{sub}"):
            out[f"algo/{sub}={opt}"] = ("config", [f"algo/{sub}={opt}"])
    out["debug=smoke"] = ("config", ["debug=smoke"])
    out["model=qwen7b,rollout=hf"] = ("config", ["model=qwen7b", "rollout=hf"])
    out["experiment=paper_7b,placement=gpu_node_h200"] = ("config", ["experiment=paper_7b", "placement=gpu_node_h200"])
    out["algo=ppo,learner=single"] = ("config", ["algo=ppo"])
    out["eval:default"] = ("eval_config", [])
    out["eval:aime24,aime25,math500"] = ("eval_config", ["eval=[aime24,aime25,math500]"])
    out["eval:model=qwen7b"] = ("eval_config", ["model=qwen7b"])
    out["eval:rollout=vllm"] = ("eval_config", ["rollout=vllm"])
    return out


def compose_flat(config_name: str, overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.helpers.config import flatten  # here: run as a script (--record), the repository joins sys.path first

    if config_name == "eval_config":
        import importlib

        sys.path.insert(0, str(ROOT))
        importlib.import_module("eval")  # registers the resolvers eval_config.yaml uses
    old = os.environ.get("BAPO_DATA_DIR")
    os.environ["BAPO_DATA_DIR"] = DATA_DIR
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
            cfg = compose(config_name=config_name, overrides=overrides)
        return flatten(OmegaConf.to_container(cfg, resolve=True))
    finally:
        os.environ.pop("BAPO_DATA_DIR") if old is None else os.environ.__setitem__("BAPO_DATA_DIR", old)


def expected(recorded: dict) -> dict:
    """The recording as the code of today should compose it: renamed keys moved, dropped ones gone, restated values."""
    out = {}
    for k, v in recorded.items():
        if k in DROPPED:
            continue
        out[RENAMED.get(k, k)] = v if isinstance(v, list | dict) else RESTATED.get((k, v), v)
    return out


def write_golden(data: dict[str, dict]) -> str:
    """The recording as text: ``[default]`` in full, then each composition's differences from it."""
    base = data["default"]
    lines = ["[default]", *(f"{k} = {json.dumps(v, sort_keys=True)}" for k, v in sorted(base.items()))]
    for name in sorted(n for n in data if n != "default"):
        flat = data[name]
        lines += ["", f"[{name}]"]
        for k in sorted(flat.keys() | base.keys()):
            if k not in flat:
                lines.append(f"{k} -")
            elif k not in base or flat[k] != base[k]:
                lines.append(f"{k} = {json.dumps(flat[k], sort_keys=True)}")
    return "\n".join(lines) + "\n"


def read_golden(text: str) -> dict[str, dict]:
    """:func:`write_golden`'s text back into flat compositions."""
    raw: dict[str, dict] = {}
    name = None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith("[") and line.endswith("]"):
            name = line[1:-1]
            raw[name] = {}
        elif line.endswith(" -"):
            raw[name][line[:-2]] = _GONE
        else:
            key, sep, value = line.partition(" = ")
            if not sep:
                raise ValueError(f"{GOLDEN.name}:{n}: not 'key = value' or 'key -': {line!r}")
            raw[name][key] = json.loads(value)
    base = raw["default"]
    out = {"default": dict(base)}
    for name, delta in raw.items():
        if name != "default":
            merged = base | delta
            out[name] = {k: v for k, v in merged.items() if v is not _GONE}
    return out


_GONE = object()
PAPER_ALGOS = ("bapo", "bapo_recipe", "grpo", "clip_higher", "ppo")  # BAPO.md's algorithm and baselines
CASES = compositions()
RECORDED = read_golden(GOLDEN.read_text()) if GOLDEN.is_file() else {}


@pytest.mark.parametrize("name", sorted(CASES.keys() & RECORDED.keys()))
def test_every_shipped_config_composes_as_recorded(name):
    config_name, overrides = CASES[name]
    now = compose_flat(config_name, overrides)
    want = expected(RECORDED[name])
    added = {k: now[k] for k in now.keys() - want.keys()}
    adds = ADDED | ADDED_IN.get(name, {})
    assert added.keys() <= adds.keys(), f"keys that are new and not in ADDED: {sorted(added.keys() - adds.keys())}"
    assert all(added[k] == adds[k] for k in added), {k: (added[k], adds[k]) for k in added if added[k] != adds[k]}
    missing = sorted(want.keys() - now.keys())
    assert not missing, f"keys that are gone and not in DROPPED or RENAMED: {missing}"
    moved = {k: (want[k], now[k]) for k in want if want[k] != now[k]}
    assert not moved, f"values that moved (recorded, now): {moved}"


def test_the_recording_guards_the_shipped_compositions():
    """The recording names no composition that no longer exists (a removed or renamed option is recorded away),
    and guards the default, the paper's algorithm and its baselines, and the paper's experiment at least; a new
    option of any group (a new loss's YAML too) is recorded when its YAML is reviewed (--record), so it is listed
    here, not failed."""
    stale = sorted(RECORDED.keys() - CASES.keys())
    assert not stale, f"recorded compositions that no longer exist: {stale} (python {GOLDEN.parent.name}/... --record)"
    must = {"default", "experiment=paper_7b", "eval:default", *(f"algo={o}" for o in PAPER_ALGOS)}
    assert must <= RECORDED.keys(), sorted(must - RECORDED.keys())
    unrecorded = sorted(CASES.keys() - RECORDED.keys())
    if unrecorded:
        print(f"not yet recorded (record them once their YAML is reviewed): {unrecorded}")


def test_the_recording_reads_back_what_was_written():
    data = {"default": {"a": 1, "b": {"x": [1]}, "c": "s"}, "o=1": {"a": 2, "b": {"x": [1]}, "d": None}}
    text = write_golden(data)
    assert text.splitlines()[-3:] == ["a = 2", "c -", "d = null"]  # one line a difference
    assert read_golden(text) == data


def record() -> None:
    data = {name: compose_flat(cfg, over) for name, (cfg, over) in compositions().items()}
    GOLDEN.write_text(write_golden(data))
    lines = len(GOLDEN.read_text().splitlines())
    print(f"{GOLDEN}: {len(data)} compositions, {lines} lines")


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        sys.path.insert(0, str(ROOT))
        record()
    else:
        sys.exit("usage: python tests/golden/test_config_golden.py --record")
