"""The hub sets by name (conf/data/skywork_or1.yaml, dapo_math.yaml, deepscaler.yaml) through bapo/data/hub.py: each
config reads a local copy written in its set's schema (tests/helpers/hubsets.py, never a download) into problems a
verifier grades, and a hub set that is neither reachable nor cached is one line naming the set, the split and the
three ways to give it locally."""

import pytest

from bapo.data.hub import load_hub
from bapo.data.loading import DataFileError, check_files, problem_sources, row_fields
from bapo.data.rows import LoadReport
from bapo.reward import MathVerifier
from tests.helpers.config import run_config
from tests.helpers.hubsets import PROBLEMS, write_dapo_math, write_deepscaler, write_skywork_or1

WRITERS = {"skywork_or1": write_skywork_or1, "dapo_math": write_dapo_math, "deepscaler": write_deepscaler}
HUB_NAMES = {
    "skywork_or1": ("Skywork/Skywork-OR1-RL-Data", "math"),
    "dapo_math": ("BytedTsinghua-SIA/DAPO-Math-17k", "train"),
    "deepscaler": ("agentica-org/DeepScaleR-Preview-Dataset", "train"),
}


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Each test's own ``datasets`` cache (datasets reads HF_DATASETS_CACHE when it loads)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    return tmp_path / "datasets-cache"


def data_of(name: str, *over: str):
    return run_config(f"data={name}", *over).data


def load_local(name: str, folder, report: LoadReport):
    """What data=<name> reads from a local copy: its own split, subset and row mapping, ``data.path`` the copy."""
    cfg = data_of(name, f"data.path={folder}")
    return load_hub(cfg.path, split=cfg.split, subset=cfg.subset, fields=row_fields(cfg), report=report)


def assert_gradable(problems):
    """A response that boxes the problem's answer scores 1 and one that boxes another answer 0."""
    answers = [p.answer for p in problems]
    wrong = answers[1:] + answers[:1]
    with MathVerifier(num_workers=0) as v:
        right, _ = v.score([f"So the answer is $\\boxed{{{a}}}$." for a in answers], answers)
        other, _ = v.score([f"So the answer is $\\boxed{{{a}}}$." for a in wrong], answers)
    assert right == [1.0] * len(answers) and other == [0.0] * len(answers)


@pytest.mark.parametrize("name", WRITERS)
def test_each_hub_config_names_its_set_and_split(name):
    cfg = data_of(name)
    assert (cfg.kind, cfg.path, cfg.split) == ("hub", *HUB_NAMES[name])


@pytest.mark.parametrize("name", WRITERS)
def test_each_hub_config_reads_a_local_copy_in_its_schema_into_gradable_problems(tmp_path, name):
    folder = WRITERS[name](tmp_path / name)
    report = LoadReport()
    problems = load_local(name, folder, report)
    # the problem text alone (the set's own instruction and any system message gone), and its answer
    assert [(p.problem, p.answer) for p in problems] == PROBLEMS
    assert_gradable(problems)


def test_skywork_or1_reads_the_math_split_and_skips_rows_no_verifier_can_grade(tmp_path, caplog):
    folder = write_skywork_or1(tmp_path / "sky")
    report = LoadReport()
    with caplog.at_level("WARNING"):
        problems = load_local("skywork_or1", folder, report)
    assert len(problems) == len(PROBLEMS)  # not the code split's row
    assert (report.rows, report.skipped) == (len(PROBLEMS), 4)  # several answers, [], "", null
    where = f"{folder}[math] row"
    n = len(PROBLEMS)
    assert f"{where} {n}: field 'reward_model.ground_truth' lists 2 different answers" in caplog.text
    assert f"{where} {n + 1}: field 'reward_model.ground_truth' is an empty list of answers" in caplog.text
    assert f"{where} {n + 2}: field 'reward_model.ground_truth' is an empty string" in caplog.text


def test_skywork_or1_trains_with_the_skipped_rows_counted_for_data_skipped_rows(tmp_path):
    folder = write_skywork_or1(
        tmp_path / "sky", PROBLEMS * 1 + [(f"What is ${i} + 1$?", str(i + 1)) for i in range(40)]
    )
    cfg = data_of("skywork_or1", f"data.path={folder}", "data.heldout_frac=0.3")
    train, held, report = problem_sources(cfg)
    assert report.skipped == 4 and held and len(train.problems) + len(held) == len(PROBLEMS) + 40
    assert not {p.problem for p in held} & {p.problem for p in train.problems}


def test_two_local_copies_of_one_name_and_a_rewritten_copy_each_load_their_own_rows(tmp_path):
    # datasets 5.2 names its prepared copy of a folder whose card lists the data files by the folder's name and those
    # patterns: before bapo.data.hub.local_cache, the second copy and the rewritten first gave the first's 10 rows
    more = [(f"What is ${i} + 1$?", str(i + 1)) for i in range(40)]
    counts = []
    for folder, problems in [("a/sky", PROBLEMS), ("b/sky", PROBLEMS + more), ("a/sky", PROBLEMS + more[:20])]:
        report = LoadReport()
        load_local("skywork_or1", write_skywork_or1(tmp_path / folder, problems), report)
        counts.append(report.rows + report.skipped)
    assert counts == [len(PROBLEMS) + 4, len(PROBLEMS) + 44, len(PROBLEMS) + 24]


def test_dapo_math_keeps_each_problem_once(tmp_path, caplog):
    folder = write_dapo_math(tmp_path / "dapo", copies=4)
    report = LoadReport()
    with caplog.at_level("INFO", logger="bapo.data.hub"):
        problems = load_local("dapo_math", folder, report)
    assert len(problems) == len(PROBLEMS) and report.rows == 4 * len(PROBLEMS) and report.skipped == 0
    assert f"{3 * len(PROBLEMS)} rows repeat an earlier row's problem and answer" in caplog.text


def test_a_local_copy_without_the_mapped_field_is_one_line_naming_the_key(tmp_path):
    folder = write_deepscaler(tmp_path / "ds")
    cfg = data_of("deepscaler", f"data.path={folder}", "data.answer_key=reward_model.ground_truth")
    with pytest.raises(
        DataFileError, match=r"^data\.answer_key: .*has no field 'reward_model\.ground_truth' \(its fields"
    ):
        load_hub(cfg.path, split=cfg.split, fields=row_fields(cfg))


@pytest.mark.parametrize("name", WRITERS)
def test_an_uncached_hub_set_offline_is_one_line_naming_the_set_split_and_three_ways(monkeypatch, name):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_DATASETS_OFFLINE=1 (conftest sets it)
    hub, split = HUB_NAMES[name]
    with pytest.raises(DataFileError) as e:
        check_files(data_of(name), None)  # before the model load
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"data.path: '{hub}' is not a local file or folder, and the hub set {hub} (split '{split}')")
    assert "neither reachable nor cached here (offline mode: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set)" in msg
    assert f"data.path=<its folder> (`hf download {hub} --repo-type dataset --local-dir <folder>`" in msg
    assert "HF_DATASETS_CACHE=<folder>" in msg and msg.endswith("JSONL with data=jsonl data.path=<file.jsonl>")
