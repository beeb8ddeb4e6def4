"""The run folder: one run holds it (a lock that dies with its holder), a fresh start never reuses another
run's files unless told to, a resume refuses config changes that would change the run, before touching
anything, and every start decision is logged in one line."""

import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bapo.config import ConfigError
from bapo.rundir import (
    ABSENT,
    LOCK_NAME,
    Change,
    RunFolder,
    record_changes,
    resume_changes,
    saved_config,
    start_decision,
)


def make_ckpt(run: Path, step: int) -> Path:
    d = run / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "state.pt").write_text("x")
    (d / "meta.json").write_text(json.dumps({"step": step}))
    return d


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its content (None for folders)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


# --------------------------------------------------------------------------------------------- the lock


def test_open_creates_the_folder_and_removes_it_if_the_run_left_nothing(tmp_path):
    run = tmp_path / "a" / "run"
    with pytest.raises(ConfigError):  # e.g. a bad resume path, found after the folder was opened
        with RunFolder.open(run):
            assert run.is_dir()
            raise ConfigError("resume: no complete checkpoint")
    assert not run.exists()
    with RunFolder.open(run) as rf:
        (rf.path / "metrics.jsonl").write_text("")
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, "metrics.jsonl"]  # the run's own folder stays
    with RunFolder.open(run):  # leaving the context released the lock (not only the process's exit)
        pass
    existing = tmp_path / "existing"
    existing.mkdir()
    with RunFolder.open(existing):
        pass
    assert existing.is_dir()  # a folder it did not create is never removed


def test_clear_removes_the_previous_run_and_nothing_else(tmp_path):
    make_ckpt(tmp_path, 4)
    for name in ["metrics.jsonl", "final_metrics.json", "config.yaml", "config_history.jsonl", "wandb_id.txt"]:
        (tmp_path / name).write_text("old")
    for d in ["export", "wandb", ".hydra"]:
        (tmp_path / d).mkdir()
        (tmp_path / d / "f").write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    with RunFolder.open(tmp_path) as rf:
        rf.clear()
        assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", LOCK_NAME, "notes.txt"]
    with pytest.raises(RuntimeError, match="no longer held"):
        rf.clear()


# ------------------------------------------------------------------------------------- start_decision


def decide(caplog, run: Path, **kw) -> tuple:
    """start_decision's decision and its log lines."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bapo.rundir"):
        p = start_decision(run, **{"resume": None, "overwrite": False, "steps": 4} | kw)
    return p, [r.getMessage() for r in caplog.records if r.name == "bapo.rundir"]


def test_a_fresh_start_is_refused_over_another_runs_checkpoints_or_metrics_and_allowed_with_overwrite(tmp_path, caplog):
    empty = tmp_path / "empty"
    p, lines = decide(caplog, empty)
    assert (p.kind, p.checkpoint, p.clear) == ("fresh", None, False)
    assert lines == [f"{empty}: starting fresh (resume=null)"]
    assert not empty.exists()  # start_decision touches nothing

    used = tmp_path / "used"
    make_ckpt(used, 2)
    (used / "metrics.jsonl").write_text('{"step": 2}\n')
    before = snapshot(used)
    with pytest.raises(ConfigError) as e:
        decide(caplog, used)
    msg = str(e.value)
    assert str(used) in msg and "resume=auto" in msg and "overwrite=true" in msg and "checkpoints/" in msg
    assert snapshot(used) == before

    only_metrics = tmp_path / "metrics_only"
    only_metrics.mkdir()
    (only_metrics / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="metrics.jsonl"):
        decide(caplog, only_metrics)

    p, lines = decide(caplog, used, overwrite=True)
    assert (p.kind, p.clear) == ("fresh", True)
    assert lines == [f"{used}: overwrite=true: removing the previous run (checkpoints/, metrics.jsonl), starting fresh"]
    with RunFolder.open(used) as rf:
        rf.clear()
    assert not (used / "checkpoints").exists() and not (used / "metrics.jsonl").exists()
    p, _ = decide(caplog, used)  # now the folder is free for a fresh start
    assert (p.kind, p.clear) == ("fresh", False)


def test_resume_auto_decisions_each_logged_in_one_line(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    p, lines = decide(caplog, run, resume="auto")
    assert (p.kind, p.clear) == ("fresh", False)
    assert lines == [f"{run}: resume=auto found no checkpoint in {run / 'checkpoints'}: starting fresh"]

    (run / "metrics.jsonl").write_text('{"step": 0}\n')  # an earlier attempt died before its first checkpoint
    p, lines = decide(caplog, run, resume="auto")
    assert (p.kind, p.clear) == ("fresh", True)
    assert len(lines) == 1 and "starting fresh, removing the earlier attempt's metrics.jsonl" in lines[0]

    make_ckpt(run, 2)
    newest = make_ckpt(run, 3)
    p, lines = decide(caplog, run, resume="auto")
    assert (p.kind, p.checkpoint, p.clear, p.source_run) == ("resume", newest, False, run)
    assert lines == [f"{run}: resume=auto: resuming from {newest}"]

    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 4}\n')
    (run / "final_metrics.json").write_text("{}")
    p, lines = decide(caplog, run, resume="auto")
    assert p.kind == "complete" and p.checkpoint is None
    assert lines == [f"{run} is complete (final_metrics.json, step 4 >= train.steps=4): nothing to do"]

    p, _ = decide(caplog, run, resume="auto", steps=6)  # more steps: a complete run is extended
    assert (p.kind, p.checkpoint) == ("resume", newest)

    with pytest.raises(ConfigError, match="resume=auto .* overwrite=true"):
        decide(caplog, run, resume="auto", overwrite=True)


def test_resume_from_a_path_and_the_swappable_checkpoint_finder(tmp_path, caplog):
    src = tmp_path / "src"
    old = make_ckpt(src, 1)
    newest = make_ckpt(src, 5)
    dst = tmp_path / "dst"
    p, lines = decide(caplog, dst, resume=str(src))
    assert (p.kind, p.checkpoint, p.clear, p.source_run) == ("resume", newest, False, src)
    assert lines == [f"{dst}: continuing the run of {src} from {newest}"]
    p, _ = decide(caplog, dst, resume=str(old))  # a checkpoint folder: that one
    assert p.checkpoint == old

    with pytest.raises(ConfigError, match="resume: no complete checkpoint in .*nowhere"):
        decide(caplog, dst, resume=str(tmp_path / "nowhere"))

    make_ckpt(dst, 9)  # dst holds a run of its own: importing another one needs overwrite
    with pytest.raises(ConfigError, match="overwrite=true"):
        decide(caplog, dst, resume=str(src))
    p, lines = decide(caplog, dst, resume=str(src), overwrite=True)
    assert (p.kind, p.checkpoint, p.clear) == ("resume", newest, True)
    assert "after removing the previous run (checkpoints/) (overwrite=true)" in lines[0]

    p, lines = decide(caplog, dst, resume=str(dst))  # its own run folder, by path
    assert (p.kind, p.checkpoint, p.clear) == ("resume", dst / "checkpoints" / "step_000009", False)
    with pytest.raises(ConfigError, match="which overwrite=true would delete"):
        decide(caplog, dst, resume=str(dst), overwrite=True)

    asked = []

    def finder(ckpt_dir: Path) -> Path:
        asked.append(ckpt_dir)
        return old

    p, _ = decide(caplog, src, resume="auto", find_latest=finder)
    assert asked == [src / "checkpoints"] and p.checkpoint == old


# -------------------------------------------------------------------------------- config changes


SAVED = {
    "seed": 1,
    "resume": None,
    "model": {"name_or_path": "assets/tiny-math", "arch": None},
    "algo": {"name": "bapo", "ratio_high": 1.2, "low_range": [0.6, 0.9]},
    "data": {"kind": "arith", "path": None},
    "rollout": {"n": 8, "batch_size": 256},
    "buffer": {"max_staleness": 4},
    "learner": {"kind": "single", "lr": 3e-4, "micro_batch_size": 64},
    "train": {"steps": 4, "prompts_per_step": 32},
    "eval": {"every": 10, "sets": []},
    "logger": {"tags": ["seed=1"], "wandb": True},
    "checkpoint": {"every": 10, "keep": 2},
    "monitor": {"entropy_frac": 0.3},
    "reward": {"num_workers": 2, "timeout_s": 5.0, "fallback": "none"},
    "paths": {"data_dir": "../shared/data"},
}


def changed(**dotted) -> dict:
    cfg = json.loads(json.dumps(SAVED))
    for key, value in dotted.items():
        *groups, leaf = key.split("__")
        node = cfg
        for g in groups:
            node = node[g]
        node[leaf] = value
    return cfg


def test_resume_changes_returns_the_harmless_changes():
    assert resume_changes(SAVED, json.loads(json.dumps(SAVED))) == []
    new = changed(
        train__steps=8,
        eval__sets=["aime24"],
        logger__tags=["seed=1", "extended"],
        checkpoint__keep=5,
        monitor__entropy_frac=0.2,
        reward__num_workers=4,
        reward__timeout_s=10.0,
        resume="auto",
        paths__data_dir="/data",
        learner__micro_batch_size=16,
        rollout__batch_size=32,
    )
    new["overwrite"] = False  # a key the saved config predates
    assert resume_changes(SAVED, new) == [
        Change("checkpoint.keep", 2, 5),
        Change("eval.sets", [], ["aime24"]),
        Change("learner.micro_batch_size", 64, 16),
        Change("logger.tags", ["seed=1"], ["seed=1", "extended"]),
        Change("monitor.entropy_frac", 0.3, 0.2),
        Change("overwrite", ABSENT, False),
        Change("paths.data_dir", "../shared/data", "/data"),
        Change("resume", None, "auto"),
        Change("reward.num_workers", 2, 4),
        Change("reward.timeout_s", 5.0, 10.0),
        Change("rollout.batch_size", 256, 32),
        Change("train.steps", 4, 8),
    ]


def test_resume_changes_refuses_every_other_difference_naming_each_key(tmp_path):
    new = changed(
        seed=2,
        model__name_or_path="other",
        model__arch={"model_type": "llama"},
        algo__ratio_high=2.0,
        algo__low_range=[0.5, 0.9],
        data__kind="jsonl",
        rollout__n=4,
        buffer__max_staleness=8,
        learner__kind="fsdp",
        learner__lr=1e-3,
        train__prompts_per_step=16,
        reward__fallback="last_number",
        train__steps=8,  # harmless, so not in the message
    )
    new["algo"]["extra"] = 1
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(SAVED))
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as e:
        resume_changes(saved_config(tmp_path), new)
    msg = str(e.value)
    for line in [
        "seed: 1 -> 2",
        "model.name_or_path: 'assets/tiny-math' -> 'other'",
        "model.arch: None -> <absent>",
        "model.arch.model_type: <absent> -> 'llama'",
        "algo.ratio_high: 1.2 -> 2.0",
        "algo.low_range: [0.6, 0.9] -> [0.5, 0.9]",
        "algo.extra: <absent> -> 1",
        "data.kind: 'arith' -> 'jsonl'",
        "rollout.n: 8 -> 4",
        "buffer.max_staleness: 4 -> 8",
        "learner.kind: 'single' -> 'fsdp'",
        "learner.lr: 0.0003 -> 0.001",
        "train.prompts_per_step: 32 -> 16",
        "reward.fallback: 'none' -> 'last_number'",
    ]:
        assert f"\n  {line}" in msg, line
    assert "train.steps: 4" not in msg
    assert snapshot(tmp_path) == before


def test_saved_config_reads_a_run_config_and_names_a_broken_file(tmp_path):
    assert saved_config(tmp_path) is None
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(SAVED), resolve=True))
    assert saved_config(tmp_path) == SAVED
    (tmp_path / "config.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="config.yaml: cannot be read"):
        saved_config(tmp_path)


def test_record_changes_appends_one_line_per_resume(tmp_path):
    record_changes(tmp_path, [], step=3)
    assert not (tmp_path / "config_history.jsonl").exists()
    record_changes(tmp_path, [Change("train.steps", 4, 8)], step=4)
    record_changes(tmp_path, [Change("eval.every", 10, 2), Change("overwrite", ABSENT, False)], step=8)
    rows = [json.loads(x) for x in (tmp_path / "config_history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8]
    assert rows[0]["changes"] == [{"key": "train.steps", "old": 4, "new": 8}]
    assert rows[1]["changes"] == [
        {"key": "eval.every", "old": 10, "new": 2},
        {"key": "overwrite", "old": "<absent>", "new": False},
    ]
    assert all("time" in r for r in rows)


# What a resume may change is what the schemas mark ``resumable`` (speed, memory, reporting and where things run:
# the same loss), listed by bapo.config.resumable_keys; no hand-kept copy of that list. These anchor it: a key a
# resume must be able to change, and one it must refuse (the loss, the data, the model's shape).
MAY_CHANGE = (
    "train.steps",
    "eval.every",
    "logger.mode",
    "checkpoint.keep",
    "reward.num_workers",
    "rollout.url",
    "learner.micro_batch_size",
    "learner.logp_check_share",
    "placement.gpus",
    "model.attn_implementation",
)
MUST_NOT = ("algo.bounds.rho0", "learner.lr", "rollout.temperature", "rollout.n", "data.path", "model.name_or_path",
            "buffer.max_staleness", "train.prompts_per_step", "seed")  # fmt: skip


def test_resumable_keys_come_from_the_schema_marks():
    """Every listed key names keys of the composed configs (a typo or a removed field would list nothing), and the
    anchors fall on their side."""
    from bapo import rundir
    from tests.helpers.config import compose

    flat = set()
    overs = ([], ["rollout=vllm"], ["rollout=vllm_server"], ["learner=fsdp"], ["placement=disaggregated"])
    overs += (["data=jsonl"],)  # the file sources' keys (data.missing_hint)
    for over in overs:
        cfg = OmegaConf.to_container(compose(*over), resolve=False)
        stack = [("", cfg)]
        while stack:
            prefix, node = stack.pop()
            for k, v in node.items():
                key = f"{prefix}{k}"
                flat.add(key)
                if isinstance(v, dict):
                    stack.append((key + ".", v))
    for key in rundir.RESUMABLE:
        stem = key.removesuffix(".*")
        assert stem in flat or stem in ("hydra",), f"{key} is listed as resumable but no composed config has it"
    assert all(rundir.resumable(k) for k in MAY_CHANGE), [k for k in MAY_CHANGE if not rundir.resumable(k)]
    assert not any(rundir.resumable(k) for k in MUST_NOT), [k for k in MUST_NOT if rundir.resumable(k)]


def test_an_unmarked_field_is_not_resumable(monkeypatch):
    """Unmark one field of a group that was all resumable: the group is listed key by key, without it."""
    from bapo import config
    from bapo.checkpoint import CheckpointConfig
    from bapo.infra import checks

    def marked(schema):
        return checks.resumable_fields(schema) - ({"keep"} if schema is CheckpointConfig else set())

    monkeypatch.setattr(config, "resumable_fields", marked)
    keys = config.resumable_keys()
    assert "checkpoint.every" in keys and "checkpoint.*" not in keys and "checkpoint.keep" not in keys
