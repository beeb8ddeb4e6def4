"""``rollout=vllm_server`` (bapo/engines/vllm_server.py) without vLLM: the command it starts its server with (the
wrapper module it runs and the worker extension the server loads are named by paths that resolve; the start stops
at ``Popen``), and the admission of its requests (bapo/engines/admission.py)."""

import importlib
import runpy
import sys
from types import SimpleNamespace

import pytest

from bapo.engines import vllm_server
from bapo.engines.vllm_extension import WeightLoader
from tests.helpers.paths import TINY


class Started(Exception):
    pass


def _started_args(monkeypatch, tmp_path) -> list[str]:
    """The command line ``_start`` hands to ``Popen`` for local rank 0 on this host."""

    def popen(args, **kw):
        raise Started(args)

    monkeypatch.setattr(vllm_server, "_bind_error", lambda host, port: None)  # no socket in a unit test
    monkeypatch.setattr(vllm_server.subprocess, "Popen", popen)
    rank = SimpleNamespace(local=0, dir=tmp_path, node_dir=None, node_ranks=1, model_path=str(TINY))
    with pytest.raises(Started) as started:
        vllm_server.VLLMServerRollout._start(rank, "127.0.0.1", 0, None, 1, [], 1.0)
    return started.value.args[0]


def _resolve(qualname: str):
    """What vLLM loads for ``--worker-extension-cls qualname`` (its ``resolve_obj_by_qualname``: the last dot splits
    the module from the attribute)."""
    module, name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def test_the_started_wrapper_is_a_module_whose_main_runs_as_a_script(monkeypatch, tmp_path):
    args = _started_args(monkeypatch, tmp_path)
    module = args[args.index("-m") + 1]
    assert args[args.index("-m") + 2] == "--parent"
    monkeypatch.setattr(sys, "argv", [module])  # no --parent: the wrapper's usage line, before vLLM is imported
    monkeypatch.delitem(sys.modules, module, raising=False)  # run as a script runs it: a fresh module
    with pytest.raises(SystemExit, match=rf"^usage: python -m {module} --parent PID"):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def test_the_worker_extension_named_to_a_server_is_the_weight_loader(monkeypatch, tmp_path):
    args = _started_args(monkeypatch, tmp_path)
    named = args[args.index("--worker-extension-cls") + 1]
    # the path docs/gpu.md gives for a server a user starts, and the one a refusal names
    assert named == vllm_server.EXTENSION == "bapo.engines.vllm_extension.WeightLoader"
    assert _resolve(named) is WeightLoader
    assert {"bapo_describe", "bapo_reload", "bapo_fingerprint"} <= vars(WeightLoader).keys()
    # a user's server started with the dotted path of the engine's module loads the same class
    assert _resolve("bapo.engines.vllm_server.WeightLoader") is WeightLoader


# ----------------------------------------------------------------------------- admission


def test_a_child_is_expected_to_hold_the_time_weighted_half_of_a_response():
    """Before 32 whole responses have finished a child is expected to run to max_tokens; then to hold, on average
    over its run, E[L^2] / (2 E[L]) tokens: lengths 100 and 300 (half each) give (100^2 + 300^2) / 2 / (2 x 200)
    = 125 (a long response runs longer, so it is met more often than a short one)."""
    from bapo.engines.admission import Admission

    a = Admission(tokens=10_000, seqs=64)
    assert a.held(1000) == 1000.0
    with a.request(10, 32, 1000, learn=True) as ticket:
        for i in range(32):
            ticket.finish(i, 100 if i % 2 else 300)
    assert a.held(1000) == 125.0 and a.held(120) == 120.0  # never more than the request's cap
    with a.request(10, 8, 50, learn=False) as ticket:  # segments under a smaller cap teach nothing
        for i in range(8):
            ticket.finish(i, 50)
    assert a.held(1000) == 125.0 and len(a.lengths) == 32


def test_a_request_waits_for_room_and_each_finished_child_makes_some():
    import threading

    from bapo.engines.admission import Admission

    a = Admission(tokens=100, seqs=64)  # children of prompt 10 + max_tokens 40: 50 tokens each, 2 fit
    first = a.request(10, 2, 40, learn=True).__enter__()
    assert a.used_tokens == 100 and a.used_seqs == 2
    admitted = threading.Event()

    def second():
        with a.request(10, 1, 40, learn=True):
            admitted.set()

    t = threading.Thread(target=second)
    t.start()
    assert not admitted.wait(0.3)  # no room
    first.finish(0, 7)  # one child's 50 tokens are free: the waiting request fits
    assert admitted.wait(10)
    t.join()
    first.finish(0, 7)  # a second finish of the same child releases nothing
    assert a.used_tokens == 50 and a.used_seqs == 1
    first.__exit__(None, None, None)  # the request ended: its unfinished child is released too
    assert a.used_tokens == 0 and a.used_seqs == 0


def test_an_aborted_admission_refuses_the_requests_waiting_for_it():
    import threading

    from bapo.engines.admission import Admission, Stopped

    a = Admission(tokens=100, seqs=64, overcommit=0.5)  # 50 tokens of room: one child of 50 at a time
    held = a.request(10, 1, 40, learn=True).__enter__()
    errors = []

    def waiter():
        try:
            with a.request(10, 1, 40, learn=True):
                pass
        except Stopped as e:
            errors.append(str(e))

    t = threading.Thread(target=waiter)
    t.start()
    a.abort()
    t.join(10)
    assert errors and "stopped before this request was sent" in errors[0]
    a.reopen()
    held.__exit__(None, None, None)
    with a.request(10, 1, 40, learn=True):
        assert a.used_seqs == 1
