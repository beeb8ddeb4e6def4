"""scripts/study/report.py on a hand-written sweep folder: the table's numbers, the plots, the crashed runs."""

import json
import math

import pytest

from scripts.study import study_stats as stats
from tests.helpers.scripts import load_script

report = load_script("study/report")
STEPS = 8  # eval at steps 0, 4 and 8


def write_run(root, algo, mini_batches, seed, *, acc, grad_norm, entropy, step_s, last=STEPS, **extra):
    """One Hydra job folder; `acc` is eval/accuracy at steps 0, 4, 8; training metrics at steps 1..last."""
    d = root / f"algo={algo},learner.mini_batches_per_rollout={mini_batches},seed={seed}"
    (d / ".hydra").mkdir(parents=True)
    overrides = [f"algo={algo}", f"learner.mini_batches_per_rollout={mini_batches}", f"seed={seed}"]
    (d / ".hydra" / "overrides.yaml").write_text(json.dumps(overrides))
    cfg = {
        "algo": {"name": algo, "bounds": {"kind": "bapo", "rho0": 0.4} if algo == "bapo" else {"kind": "fixed"}},
        "buffer": {"max_staleness": 4},
        "learner": {"ppo_epochs": 1, "mini_batches_per_rollout": mini_batches},
        "train": {"steps": STEPS},
        "seed": seed,
    }
    (d / "config.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    rows = [{"step": 0, "eval/accuracy": acc[0], "eval/accuracy_greedy": acc[0], "time/eval_s": 12.0}]
    for step in range(1, last + 1):
        row = {"step": step, "reward/mean": 0.1 * step, "learner/entropy": entropy[step - 1]}
        row |= {"learner/grad_norm": grad_norm[step - 1], "time/step_s": step_s, "buffer/served": 16}
        row |= {"learner/clip_frac_pos": 0.01 * step, "learner/clip_frac_neg": 0.02}
        if algo == "bapo":
            row |= {"clip/low": 0.6, "clip/high": 1.2 + 0.1 * step, "clip/rho": 0.4, "bapo/rho_before": 0.3}
        if step % 4 == 0:
            row |= {"eval/accuracy": acc[step // 4], "eval/accuracy_greedy": acc[step // 4] + 0.1}
        rows.append(row)
    lines = [json.dumps(r) for r in rows]
    for line_no, text in extra.get("bad_lines", {}).items():
        lines.insert(line_no - 1, text)
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if last == STEPS:
        (d / "final_metrics.json").write_text(json.dumps(rows[-1]))
    return d


ENT = [0.5] * 7


@pytest.fixture()
def sweep(tmp_path):
    root = tmp_path / "multirun" / "ablation"
    # grpo, staleness 0: two complete seeds and one crash at step 5 (traceback in train.log, no checkpoint)
    write_run(
        root, "grpo", 1, 1, acc=[0.2, 0.5, 0.4], grad_norm=[1, 1, 1, 1, 1, 10, 1, 1], entropy=ENT + [0.3], step_s=6.0
    )
    write_run(
        root, "grpo", 1, 2, acc=[0.2, 0.3, 0.6], grad_norm=[1, 2, 1, 2, 1, 2, 7, 9], entropy=ENT + [0.5], step_s=13.5
    )
    crashed = write_run(root, "grpo", 1, 3, acc=[0.2, 0.9], grad_norm=[1] * 5, entropy=ENT, step_s=6.0, last=5)
    (crashed / "train.log").write_text(
        'step 5 ...\nTraceback (most recent call last):\n  File "x.py", line 1\n    f()\nRuntimeError: boom\n'
    )
    # bapo, staleness 2: two complete seeds, one with a malformed line and an empty line; one interrupted
    write_run(root, "bapo", 3, 1, acc=[0.2, 0.7, 0.8], grad_norm=[1] * 8, entropy=ENT + [0.4], step_s=6.0)
    bad = {4: '{"step": 3, "reward/mean": 0.', 6: ""}
    write_run(
        root, "bapo", 3, 2, acc=[0.2, 0.9, 0.6], grad_norm=[1] * 8, entropy=ENT + [0.4], step_s=6.0, bad_lines=bad
    )
    resumable = write_run(root, "bapo", 3, 3, acc=[0.2], grad_norm=[1] * 3, entropy=ENT, step_s=6.0, last=3)
    (resumable / "checkpoints").mkdir()
    # clip_higher, staleness 4: died before logging anything (Hydra's own config only)
    d = root / "algo=clip_higher,learner.mini_batches_per_rollout=5,seed=1" / ".hydra"
    d.mkdir(parents=True)
    cfg = {"algo": {"name": "clip_higher"}, "learner": {"mini_batches_per_rollout": 5}, "train": {"steps": STEPS}}
    (d / "config.yaml").write_text(json.dumps(cfg | {"seed": 1}))
    (root / "multirun.yaml").write_text("hydra: {}\n")
    # an eval.py folder (no train key, no metrics) is not a training run
    (root / "eval" / ".hydra").mkdir(parents=True)
    (root / "eval" / ".hydra" / "config.yaml").write_text(json.dumps({"checkpoint": None, "k": 4}))
    return root


def table(md: str, heading: str) -> list[dict]:
    """The Markdown table under `## heading`, as one dict per row."""
    section = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split(" | ")]
        for line in section.splitlines()
        if line.startswith("|")
    ]
    return [dict(zip(rows[0], r, strict=True)) for r in rows[2:]]


def test_report_table_plots_and_crashes(sweep, tmp_path, capsys):
    out = tmp_path / "out"
    assert report.main([str(sweep), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    rows = {(r["algo"], r["staleness"]): r for r in table(md, "Results")}
    # sorted by staleness; the parentheses say how the samples get stale
    assert list(rows) == [("grpo", "0"), ("bapo", "2 (3 mini-batches)"), ("clip_higher", "4 (5 mini-batches)")]

    grpo = rows[("grpo", "0")]
    # final acc 0.4, 0.6: mean 0.5, sample std sqrt((0.1^2 + 0.1^2) / 1) = 0.1414
    assert grpo["final acc"] == "0.500 ± 0.141"
    # best 0.5, 0.6: mean 0.55, std sqrt(2 * 0.05^2) = 0.0707
    assert grpo["best acc"] == "0.550 ± 0.071"
    assert grpo["final greedy acc"] == "0.600 ± 0.141"  # greedy = acc + 0.1 at steps 4 and 8
    assert grpo["entropy (end)"] == "0.400 ± 0.141"  # 0.3 and 0.5
    # seed 1: step 6's 10 > 3 x median(1,1,1,1,1) -> 1 spike.
    # seed 2: step 7's 7 > 3 x median(1,2,1,2,1,2) = 4.5 and step 8's 9 > 3 x median(..., 7) = 6 -> 2 spikes;
    # step 6's 2 is not > 3 x median(1,2,1,2,1) = 3. Mean 1.5, std 0.707.
    assert grpo["grad-norm spikes"] == "1.5 ± 0.7"
    # wall: 12 s (step 0 eval) + 8 x 6 s = 60 s = 1 min; 12 + 8 x 13.5 = 120 s = 2 min
    assert grpo["wall time (min)"] == "1.5 ± 0.7"
    assert (grpo["seeds"], grpo["incomplete"], grpo["max_staleness"]) == ("2", "1", "4")

    bapo = rows[("bapo", "2 (3 mini-batches)")]
    assert bapo["final acc"] == "0.700 ± 0.141"  # 0.8 and 0.6; the interrupted seed (0.2) is left out
    assert bapo["best acc"] == "0.850 ± 0.071"  # 0.8 and 0.9
    assert bapo["grad-norm spikes"] == "0.0 ± 0.0"
    assert (bapo["seeds"], bapo["incomplete"]) == ("2", "1")

    clip = rows[("clip_higher", "4 (5 mini-batches)")]
    assert (clip["final acc"], clip["seeds"], clip["incomplete"], clip["max_staleness"]) == ("—", "0", "1", "?")

    incomplete = {r["algo"]: r for r in table(md, "Incomplete runs")}
    assert set(incomplete) == {"grpo", "bapo", "clip_higher"} and "7 runs, 4 complete, 3 incomplete" in md
    assert incomplete["grpo"]["status"] == "incomplete at step 5 of 8; no checkpoint; train.log: RuntimeError: boom"
    assert incomplete["grpo"]["seed"] == "3"
    assert incomplete["bapo"]["status"] == "incomplete at step 3 of 8; resumable (checkpoints/)"
    assert incomplete["clip_higher"]["status"] == "no metrics logged (of 8); no checkpoint"
    assert "`algo=bapo,learner.mini_batches_per_rollout=3,seed=3`" == incomplete["bapo"]["run"]

    metrics = sweep / "algo=bapo,learner.mini_batches_per_rollout=3,seed=2" / "metrics.jsonl"
    assert f"`{metrics}:4: unparseable JSON (" in md
    assert f"`{metrics}:6: empty line`" in md
    assert f"{metrics}:4: unparseable JSON" in capsys.readouterr().err

    names = ["curves_eval_accuracy", "curves_reward_mean", "curves_learner_entropy", "curves_learner_grad_norm"]
    for name in [*names, "bapo_bounds", "bapo_rho"]:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name}.png)" in md


@pytest.mark.slow
def test_default_out_is_inside_the_sweep_and_rerun_is_stable(sweep):
    assert report.main([str(sweep)]) == 0
    first = (sweep / "report" / "report.md").read_text()
    assert report.main([str(sweep)]) == 0  # the report folder is not mistaken for a run
    assert (sweep / "report" / "report.md").read_text() == first


def tree(root) -> dict:
    """Every path under ``root`` with its bytes (None for a folder): a snapshot to compare before and after."""
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "case",
    ["missing folder", "empty folder", "not a pack", "--smooth 0", "--smooth x", "unknown flag", "--out a file"],
)
def test_bad_input_is_one_error_line_exit_2_and_writes_nothing(case, sweep, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a pack\n")
    argv = {
        "missing folder": [str(tmp_path / "nope")],
        "empty folder": [str(tmp_path / "empty")],
        "not a pack": [str(tmp_path / "notes.txt")],
        "--smooth 0": [str(sweep), "--smooth", "0"],
        "--smooth x": [str(sweep), "--smooth", "x"],
        "unknown flag": [str(sweep), "--colour"],
        "--out a file": [str(sweep), "--out", str(tmp_path / "notes.txt" / "report")],
    }[case]
    before = tree(tmp_path)
    try:
        status = report.main(argv)
    except SystemExit as e:  # argparse's errors leave through UsageParser.error
        status = e.code
    assert status == 2
    one_error_line(capsys)
    assert tree(tmp_path) == before


def test_staleness_of():
    learner = {"ppo_epochs": 2, "mini_batches_per_rollout": 3}
    assert report.staleness_of({"learner": learner, "buffer": {"max_staleness": 9}}) == 5
    assert report.staleness_of({"learner": {"mini_batches_per_rollout": 3}}) == 2  # ppo_epochs defaults to 1
    assert (
        report.staleness_of({"train": {"async_rollout": True}, "learner": learner, "buffer": {"max_staleness": 4}}) == 4
    )
    assert report.staleness_of({"train": {"async_rollout": False}, "learner": learner}) == 5
    assert report.staleness_of({}) is None
    assert report.staleness_of({"learner": {"mini_batches_per_rollout": "${x}"}}) is None


def test_partial_rollouts_add_their_lag_to_the_staleness_and_name_the_budget():
    # budget 14 of 56 tokens: up to 4 segments, so a token waits up to 3 steps; at U = 1 it is 3 versions old,
    # at U = 2 (2 mini-batches) 2 * 4 - 1 = 7; a budget of the whole cap (or none) interrupts nothing
    one = {"learner": {"ppo_epochs": 1, "mini_batches_per_rollout": 1}}
    part = one | {"rollout": {"partial_budget": 14, "max_new_tokens": 56}}
    assert report.staleness_of(part) == 3 and report.staleness_via(part) == "partial 14/56"
    assert report.staleness_of(one | {"rollout": {"partial_budget": 28, "max_new_tokens": 56}}) == 1
    assert report.staleness_of(one | {"rollout": {"partial_budget": 20, "max_new_tokens": 56}}) == 2  # ceil(56/20)=3
    two = part | {"learner": {"ppo_epochs": 1, "mini_batches_per_rollout": 2}}
    assert report.staleness_of(two) == 7 and report.staleness_via(two) == "2 mini-batches, partial 14/56"
    for whole in (56, 64, None):
        cfg = one | {"rollout": {"partial_budget": whole, "max_new_tokens": 56}}
        assert report.staleness_of(cfg) == 0 and report.staleness_via(cfg) == "on-policy"


def test_staleness_via():
    via = report.staleness_via
    assert via({"learner": {"ppo_epochs": 1, "mini_batches_per_rollout": 1}}) == "on-policy"
    assert via({"learner": {"ppo_epochs": 5, "mini_batches_per_rollout": 1}}) == "5 epochs"
    assert via({"learner": {"mini_batches_per_rollout": 5}}) == "5 mini-batches"  # ppo_epochs defaults to 1
    assert via({"learner": {"ppo_epochs": 2, "mini_batches_per_rollout": 3}}) == "2 epochs × 3 mini-batches"
    async_cfg = {"train": {"async_rollout": True}, "buffer": {"max_staleness": 8}}
    assert via(async_cfg | {"learner": {"ppo_epochs": 1, "mini_batches_per_rollout": 1}}) == "async"
    assert via(async_cfg | {"learner": {"ppo_epochs": 1, "mini_batches_per_rollout": 2}}) == "async, 2 mini-batches"
    assert via({}) == "?"
    assert via({"learner": {"ppo_epochs": "${x}", "mini_batches_per_rollout": 1}}) == "?"


def test_same_staleness_two_ways_are_two_groups(tmp_path):
    """5 epochs and 5 mini-batches both reach staleness 4; pooling them would average two regimes."""
    root = tmp_path / "sweep"
    acc, kw = [0.2, 0.3, 0.4], {"grad_norm": [1] * STEPS, "entropy": [0.5] * STEPS, "step_s": 6.0}
    write_run(root, "grpo", 5, 1, acc=acc, **kw)
    epochs = write_run(root / "epochs", "grpo", 1, 1, acc=[0.2, 0.0, 0.0], **kw)
    cfg = json.loads((epochs / "config.yaml").read_text())
    cfg["learner"]["ppo_epochs"] = 5
    (epochs / "config.yaml").write_text(json.dumps(cfg))
    _, runs = report.load_runs(root)
    groups = report.group_runs(runs)
    assert list(groups) == [("grpo", report.Level(4, "5 epochs")), ("grpo", report.Level(4, "5 mini-batches"))]
    out = tmp_path / "out"
    assert report.main([str(root), "--out", str(out)]) == 0
    rows = {r["staleness"]: r for r in table((out / "report.md").read_text(), "Results")}
    assert (rows["4 (5 epochs)"]["final acc"], rows["4 (5 mini-batches)"]["final acc"]) == ("0.000 (floor)", "0.400")


def test_count_spikes():
    assert report.count_spikes([1, 100, 1, 1, 1, 1]) == 0  # too little history at step 2
    assert report.count_spikes([1, 1, 1, 1, 1, 3.01, 3.0]) == 1  # strictly above 3 x median 1
    assert report.count_spikes([1, 1, math.nan, 1, 1, 1, 4]) == 1  # NaN neither counts nor joins the history


def test_label_keeps_algo_overrides(tmp_path):
    (tmp_path / ".hydra").mkdir()
    overrides = ["algo=bapo", "algo.contribution=gradient", "seed=2"]
    (tmp_path / ".hydra" / "overrides.yaml").write_text(json.dumps(overrides))
    assert report.load_run(tmp_path).label == "bapo[contribution=gradient]"  # no config: the algo= override
    assert report.label_of(overrides, {"algo": {"name": "bapo"}}) == "bapo[contribution=gradient]"
    # a sub-group override (a rollout correction) is an arm of its own, not the plain algorithm
    overrides = ["algo=grpo", "algo/correction=tis", "learner.old_logp=recompute"]
    assert report.label_of(overrides, {"algo": {"name": "grpo"}}) == "grpo[correction=tis]"


# ------------------------------------------------------------------------------------ statistics
# (the interval method itself: tests/unit/scripts/test_report_stats.py)


def test_report_has_interval_paired_and_pathology_tables(sweep, tmp_path):
    out = tmp_path / "rep"
    assert report.main([str(sweep), "--out", str(out), "--reference", "grpo"]) == 0
    text = (out / "report.md").read_text()
    for title in ("## Intervals over seeds", "## Paired against grpo", "## Pathology checks"):
        assert title in text
    # grpo at staleness 0 has two complete seeds with final accuracy 0.4 and 0.6: mean 0.5, s = 0.1414,
    # s / sqrt(2) = 0.1, t_{0.975, 1} = 12.706 -> 0.5 -+ 1.2706; two seeds: descriptive only
    rows = {(r["algo"], r["staleness"]): r for r in table(text, "Intervals over seeds")}
    assert rows[("grpo", "0")]["final acc"] == "0.500 [-0.771, 1.771] t, n=2"
    assert rows[("grpo", "0")]["reading"] == "n < 5: descriptive only"
    assert rows[("grpo", "0")]["eval samples"] == "?"  # the hand-written configs carry no eval.n
    # the pathology row of grpo: entropy 0.5 at the first step; its two seeds end at 0.3 and 0.5 (mean 0.4)
    assert "| grpo | 0 | 0.500 → 0.400 (0.400) | 0.80 |" in text
    # bapo's rho_before is 0.3 < rho0 0.4 on every step
    assert text.count("| 100% |") >= 1
    for png in ("clip_window.png", "clip_by_sign.png", "acc_vs_samples.png", "acc_vs_wall.png"):
        assert (out / png).is_file(), png


def test_interval_cell_names_its_method_and_n():
    assert report._ci(stats.Interval(0.5, 0.4, 0.6, 2, 0.1)) == "0.500 [0.400, 0.600] t, n=2"
    paired = report._ci(stats.Interval(0.01, -0.02, 0.04, 10, 0.5), "{:+.3f}", "paired t")
    assert paired == "+0.010 [-0.020, +0.040] paired t, n=10"
    # one seed: the value and its n, no interval (a zero-width "interval" from one seed would mislead)
    assert report._ci(stats.t_interval([0.5])) == "0.500 (n=1)"
    assert report._ci(stats.t_interval([])) == report.DASH


def test_pathology_counts_updates_and_updates_with_a_signal(tmp_path):
    # 4 steps of 5 updates: search_active is each step's share of updates whose search moved, signal the share
    # with any advantage. Hand count: active 2+1+0+3 = 6 of 20 updates (30%); signal 4+2+0+5 = 11, so 6/11.
    d = write_run(tmp_path, "bapo", 5, 1, acc=[0.2, 0.3, 0.1], grad_norm=[1.0] * 8, entropy=[0.5] * 8, step_s=1.0)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    active, signal = [0.4, 0.2, 0.0, 0.6], [0.8, 0.4, 0.0, 1.0]
    training = [r for r in rows if r["step"] >= 1][:4]
    for r, a, s in zip(training, active, signal, strict=True):
        r |= {"bapo/search_active": a, "bapo/signal": s}
    rows = [r for r in rows if r["step"] <= 4]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    p = report.load_run(d).pathology()
    assert p["rho_below_share"] == pytest.approx(6 / 20)
    assert p["rho_below_signal_share"] == pytest.approx(6 / 11)


# ------------------------------------------------------------------------------------ cells


def lr_sweep(root, lrs=(1e-5, 1e-3), seeds=(1,), accs=None):
    """grpo and bapo at each learning rate, one folder per run as Hydra names them; final accuracy ``accs[lr]``
    (default: 0.2 at the first lr, 0.6 at the second), grpo 0.1 below bapo."""
    accs = accs or {lrs[0]: 0.2, lrs[1]: 0.6}
    kw = {"grad_norm": [1] * STEPS, "entropy": [0.5] * STEPS, "step_s": 6.0}
    for algo in ("grpo", "bapo"):
        for lr in lrs:
            for seed in seeds:
                acc = accs[lr] - (0.1 if algo == "grpo" else 0.0) + 0.01 * seed
                d = write_run(root / f"lr={lr}", algo, 2, seed, acc=[0.1, acc, acc], **kw)
                overrides = json.loads((d / ".hydra" / "overrides.yaml").read_text())
                (d / ".hydra" / "overrides.yaml").write_text(json.dumps([*overrides, f"learner.lr={lr}"]))
                cfg = json.loads((d / "config.yaml").read_text())
                cfg["learner"]["lr"] = lr
                cfg["data"] = {"train_seed": seed}  # composed from the seed: not a difference
                (d / "config.yaml").write_text(json.dumps(cfg))


def test_runs_that_differ_in_anything_but_the_seed_are_never_pooled(tmp_path):
    """learner.lr=1e-5,1e-3 at seed 1: two cells of one seed each, never one cell of "2 seeds" with an interval
    (today's code pooled them by algo x staleness: grpo's final accuracy read 0.110 + 0.510 over 2 = 0.310 ± 0.283)."""
    root = tmp_path / "sweep"
    lr_sweep(root)
    out = tmp_path / "out"
    assert report.main([str(root), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    rows = {r["algo"]: r for r in table(md, "Results")}
    assert sorted(rows) == [f"{a} (learner.lr={lr})" for a in ("bapo", "grpo") for lr in ("0.001", "1e-05")]
    for name, row in rows.items():
        assert (row["seeds"], row["incomplete"]) == ("1", "0"), name
    assert rows["grpo (learner.lr=1e-05)"]["final acc"] == "0.110"  # 0.2 - 0.1 + 0.01, alone
    assert rows["grpo (learner.lr=0.001)"]["final acc"] == "0.510"
    assert "## Intervals over seeds" not in md  # no cell has two seeds
    assert "named by those keys: `bapo (learner.lr=0.001)`" in md


def test_a_cell_pools_its_seeds_and_pairs_with_the_reference_at_the_same_settings(tmp_path):
    root = tmp_path / "sweep"
    lr_sweep(root, seeds=(1, 2, 3, 4, 5))
    # a key only one run's code wrote, with the value every run had (a config schema change): not a setting
    d = root / "lr=0.001" / "algo=bapo,learner.mini_batches_per_rollout=2,seed=5"
    cfg = json.loads((d / "config.yaml").read_text())
    (d / "config.yaml").write_text(json.dumps(cfg | {"rollout": {"workers": 1}}))
    _, runs = report.load_runs(root)
    groups = report.group_runs(runs)
    assert {name: len(g) for (name, _), g in groups.items()} == {
        f"{a} (learner.lr={lr})": 5 for a in ("bapo", "grpo") for lr in ("0.001", "1e-05")
    }
    rows = report.paired_rows(groups, "bapo")
    # grpo is 0.1 below bapo at every seed and either lr: each pair is of one lr
    assert {(r["arm"], r["key"]): round(r["stat"].mean, 6) for r in rows} == {
        (f"grpo (learner.lr={lr})", key): -0.1 for lr in ("0.001", "1e-05") for key in ("final", "best")
    }
    assert all(r["stat"].n == 5 for r in rows)


def test_a_key_with_two_values_is_a_setting_even_where_a_run_lacks_it(tmp_path):
    root = tmp_path / "sweep"
    lr_sweep(root)
    for lr, width in ((1e-5, 2), (1e-3, 4)):
        d = root / f"lr={lr}" / "algo=grpo,learner.mini_batches_per_rollout=2,seed=1"
        cfg = json.loads((d / "config.yaml").read_text())
        (d / "config.yaml").write_text(json.dumps(cfg | {"rollout": {"workers": width}}))
    extra = write_run(root / "old", "grpo", 2, 1, acc=[0.1, 0.3, 0.3], grad_norm=[1] * 8, entropy=ENT + [0.5], step_s=6)
    cfg = json.loads((extra / "config.yaml").read_text())
    (extra / "config.yaml").write_text(json.dumps(cfg | {"learner": cfg["learner"] | {"lr": 1e-5}}))
    _, runs = report.load_runs(root)
    names = sorted(name for name, _ in report.group_runs(runs) if name.startswith("grpo"))
    assert names == [
        "grpo (learner.lr=0.001, rollout.workers=4)",
        "grpo (learner.lr=1e-05, rollout.workers=2)",
        "grpo (learner.lr=1e-05, rollout.workers=—)",
    ]


def test_cell_config_leaves_out_the_seed_and_the_bookkeeping():
    cfg = {
        "seed": 3,
        "data": {"train_seed": 3, "heldout_seed": 1234, "path": "a.jsonl"},
        "learner": {"lr": 1e-5, "betas": [0.9, 0.999], "packing": True},
        "logger": {"tags": ["seed=3"], "mode": "online"},
        "resume": "auto",
        "overwrite": False,
        "eval": {"sets": {}},
    }
    assert report.cell_config(cfg) == {
        "data.heldout_seed": "1234",
        "data.path": '"a.jsonl"',
        "learner.lr": "1e-05",
        "learner.betas": "[0.9, 0.999]",
        "learner.packing": "true",
        "eval.sets": "{}",
    }
    # a *seed* key that is not the run's seed is a setting; True == 1 is not mistaken for seed 1
    assert report.cell_config({"seed": 1, "data": {"train_seed": 7}, "x": {"seeded": True}}) == {
        "data.train_seed": "7",
        "x.seeded": "true",
    }
