"""The worker pool: isolation, time limits, failures, and what runs where.

Workers are subprocesses that never import the caller's ``__main__``; each pair,
normalisation included, runs under the alarm in a worker; a worker that hangs
beyond the alarm's reach is killed and replaced; the trainer keeps only short,
linear work; ``num_workers=0`` refuses to grade off the main thread.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bapo.reward import MathVerifier, score_math
from bapo.reward.pool import FAST_PATH_MAX_CHARS
from bapo.reward.verify import check_pair

REPO = Path(__file__).resolve().parents[3]


def crashing_judge(pred, gold):
    """Dies like a segfault or a hard exit on marked inputs; otherwise the real check."""
    if pred == "exit":
        os._exit(3)
    if pred == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if pred == "hang":  # stuck where the alarm cannot reach, like a long C call
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    return check_pair(pred, gold)


CRASHING = f"{__name__}:crashing_judge"


def tricky_judge(pred, gold):
    """Prints to stdout (the worker's protocol channel must survive it); spins in Python on "spin"."""
    print("[0, true, false]")  # looks like an answer; must not be read as one
    while pred == "spin":  # a pure-Python loop: the alarm can stop it, so the worker survives
        pass
    return check_pair(pred, gold)


TRICKY = f"{__name__}:tricky_judge"


def test_whole_judge_runs_under_the_alarm():
    with MathVerifier(num_workers=1, timeout_s=1.0, hard_timeout_s=20.0, judge=TRICKY) as v:
        rewards, stats = v.score([r"\boxed{spin}", r"\boxed{0.5}", r"\boxed{0.4}"], ["1", r"\frac12", r"\frac12"])
        pid = v._workers[0].proc.pid
        assert rewards == [0.0, 1.0, 0.0]
        assert stats["reward/timeouts"] == 1  # the alarm, not the hard deadline (20 s) ...
        assert stats["reward/worker_failures"] == 0  # ... so the worker was not killed
        assert v.score([r"\boxed{0.25}"], [r"\frac14"])[0] == [1.0]
        assert v._workers[0].proc.pid == pid


def test_unguarded_script_runs_once(tmp_path):
    """A script with no __main__ guard prints once: workers never import the caller's __main__.

    The script's working directory also holds a ``json.py`` that raises on import:
    workers do not put the caller's cwd on their path, so it cannot shadow a module.
    """
    script = tmp_path / "plain.py"
    script.write_text(
        "from bapo.reward import score_math\n"
        "print('hello', flush=True)\n"
        "print(score_math(r'\\boxed{0.5}', r'\\frac12'), score_math(r'\\boxed{0.4}', r'\\frac12'))\n"
    )
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "json.py").write_text("raise ImportError('the cwd leaked onto a worker path')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello\n1.0 0.0\n"
    assert time.monotonic() - start < 30.0  # a hang guard: it takes a second or two


def test_long_strings_skip_the_fast_path():
    """Only short strings are normalised in the caller; a long pair goes to a worker, which still gets it right."""
    long = "1" * (FAST_PATH_MAX_CHARS + 1)
    with MathVerifier(num_workers=1, timeout_s=5.0) as v:
        rewards, stats = v.score([f"\\boxed{{{long}}}", r"\boxed{033}"], [long, "33"])
    assert rewards == [1.0, 1.0]
    assert (stats["reward/fast_path"], stats["reward/verified"]) == (1, 1)


N = 40_000
# (response, gold, reward): ~40k characters built to make backtracking regexes or sympy blow up.
# fmt: off
ADVERSARIAL = [
    ("\\boxed{" + "0" * N + "x}", "5", 0.0),  # "(-?)0*(\d+)" was quadratic here: 20 s
    ("\\boxed{" + "0" * N + "5}", "5", 1.0),  # the same regex, on an answer that is right
    ("\\boxed{90^" + " " * N + "x}", "90", 0.0),  # "\^\s*\{?\s*\\circ" was quadratic here
    ("\\boxed{" + "7" * N + "}", "7" * N, 1.0),
    ("\\boxed{1" + " " * N + "x}", "1", 0.0),
    ("\\boxed{" + "\\\\" * (N // 2) + "}", "1", 0.0),
    ("\\boxed{" + "{" * (N // 2) + "}" * (N // 2) + "}", "1", 0.0),
    ("\\boxed{" + "\\frac{1}{" * (N // 9) + "2" + "}" * (N // 9) + "}", "1", 0.0),
    ("\\boxed{" + "\\text{a" * (N // 7) + "}", "a", 0.0),
    ("\\boxed{1" + ",000" * (N // 4) + "x}", "1", 0.0),
    ("\\boxed{" + "1 " * (N // 2) + "}", "1", 0.0),
    ("$" + "\\boxed{" * (N // 7) + "1", "1", 0.0),
]
# fmt: on


@pytest.mark.slow
@pytest.mark.parametrize("response, gold, reward", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_are_bounded(adversarial_verifier, response, gold, reward):
    start = time.monotonic()
    rewards, stats = adversarial_verifier.score([response], [gold])
    elapsed = time.monotonic() - start
    assert rewards == [reward]
    assert elapsed < 3 * adversarial_verifier.timeout_s, elapsed  # a hang guard: the alarm fires at 1x


@pytest.fixture(scope="module")
def adversarial_verifier():
    with MathVerifier(num_workers=1, timeout_s=1.5) as v:
        v.score([r"\boxed{0.5}"], [r"\frac12"])  # started and warm: the bound below is for grading alone
        yield v


def test_num_workers_0_refuses_to_grade_off_the_main_thread():
    errors = []

    def grade(verifier):
        try:
            errors.append(verifier.score([r"\boxed{0.5}"], [r"\frac12"])[0])
        except RuntimeError as e:
            errors.append(e)

    inline = MathVerifier(num_workers=0)
    thread = threading.Thread(target=grade, args=(inline,))
    thread.start()
    thread.join(timeout=60)
    assert isinstance(errors[0], RuntimeError) and "reward.num_workers" in str(errors[0])
    assert inline.score([r"\boxed{0.5}"], [r"\frac12"])[0] == [1.0]  # the main thread is fine
    with MathVerifier(num_workers=1, timeout_s=1.0) as pooled:  # a pool grades from any thread
        thread = threading.Thread(target=grade, args=(pooled,))
        thread.start()
        thread.join(timeout=60)
    assert errors[1] == [1.0]


def test_pathological_input_times_out():
    with MathVerifier(num_workers=1, timeout_s=1.0) as v:
        start = time.monotonic()
        rewards, stats = v.score([r"So the answer is $\boxed{9^{9^{9^{9}}}}$.", r"\boxed{0.5}"], ["1", r"\frac12"])
        elapsed = time.monotonic() - start
    assert rewards == [0.0, 1.0]
    assert stats["reward/timeouts"] == 1
    assert elapsed < 10.0


@pytest.mark.slow
@pytest.mark.parametrize("marker, timed_out", [("exit", 0), ("segv", 0), ("hang", 1)])
def test_worker_failure_is_contained(marker, timed_out):
    responses = [
        r"\boxed{0.5}",
        r"\boxed{" + marker + "}",
        r"\boxed{\frac{2}{4}}",
        r"\boxed{0.25}",
        r"\boxed{3}",
    ]
    answers = [r"\frac12", "1", r"\frac12", r"\frac12", "3"]
    with MathVerifier(num_workers=1, timeout_s=1.0, hard_timeout_s=2.0, chunk_size=8, judge=CRASHING) as v:
        v.score([r"\boxed{0.5}"], [r"\frac12"])  # started: the bound below is for containment and replacement
        start = time.monotonic()
        rewards, stats = v.score(responses, answers)
        assert time.monotonic() - start < 15.0
        assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert stats["reward/worker_failures"] == 1
        assert stats["reward/timeouts"] == timed_out
        # The replacement worker keeps scoring.
        rewards, stats = v.score([r"\boxed{0.75}", r"\boxed{1}"], [r"\frac34", "2"])
        assert rewards == [1.0, 0.0]
        assert stats["reward/worker_failures"] == 0
        procs = [w.proc for w in v._workers]
    assert all(w is None for w in v._workers) and all(p.poll() is not None for p in procs)  # closed on exit


def test_pool_reuse_close_and_restart():
    v = MathVerifier(num_workers=2, timeout_s=2.0, chunk_size=2)
    batch = ([r"\boxed{0.5}"] * 3 + [r"\boxed{\frac{1}{3}}"] * 3, [r"\frac12"] * 6)
    first = v.score(*batch)
    pids = {w.proc.pid for w in v._workers if w is not None}
    second = v.score(*batch)
    assert {w.proc.pid for w in v._workers if w is not None} == pids  # reused, not restarted
    assert first[0] == second[0] == [1.0] * 3 + [0.0] * 3
    assert first[1]["reward/verified"] == 6
    v.close()
    assert all(w is None for w in v._workers)
    assert v.score(*batch)[0] == first[0]  # a closed verifier starts again on demand
    v.close()


def test_mismatched_lengths_and_bad_settings():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        MathVerifier(num_workers=0).score(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="fallback"):
        MathVerifier(fallback="first_line")
    with pytest.raises(ValueError, match="module:function"):
        MathVerifier(judge="check_pair")
    with pytest.raises(ValueError, match="__main__"):
        MathVerifier(judge="__main__:judge")
    with pytest.raises(ValueError, match="no function 'nope'"):
        MathVerifier(judge="bapo.reward.verify:nope")
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifier(timeout_s=0)


def test_score_math_in_fresh_interpreter():
    code = (
        "from bapo.reward import score_math\n"
        "r = [score_math(r'So $x = \\boxed{\\dfrac{1}{2}}$.', '0.5'), score_math('\\\\boxed{3}', '4'),"
        " score_math('no box 4', '4')]\n"
        "print(repr(r), all(type(x) is float for x in r))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 0.0, 0.0] True"


def test_score_math_returns_float():
    assert score_math(r"The answer is $\boxed{\frac{\pi}{2}}$.", r"\frac{\pi}{2}") == 1.0
    assert score_math(r"The answer is $\boxed{\pi}$.", r"\frac{\pi}{2}") == 0.0


def test_score_math_names_the_batch_api_when_given_lists():
    with pytest.raises(TypeError, match=r"grades one response.*got list and list.*MathVerifier\(\)\.score"):
        score_math(["\\boxed{4}"], ["4"])


def slow_judge(pred, gold):
    """The real check, a second late: a stop's signal arrives while the pair is in flight."""
    time.sleep(1.0)
    return check_pair(pred, gold)


SLOW = f"{__name__}:slow_judge"


def test_a_stop_signal_to_the_process_group_does_not_turn_rewards_into_zero():
    """The elastic launcher passes a stop on to each rank's whole process group (scancel signals every process of
    the job): the reward workers get SIGTERM, SIGHUP and SIGUSR1 too, with pairs in flight. They ignore them; the
    pairs are graded as without the signal, and no worker is lost."""
    responses = [r"\boxed{0.5}", r"\boxed{0.3}", r"\boxed{0.25}", r"\boxed{0.75}"]
    answers = [r"\frac12", r"\frac14", r"\frac14", r"\frac34"]  # none the same text: every pair is verified
    with MathVerifier(num_workers=2, timeout_s=5.0, judge=SLOW) as v:
        v.score([r"\boxed{0.5}", r"\boxed{0.2}"], [r"\frac12", r"\frac15"])  # both workers started and ready
        pids = [w.proc.pid for w in v._workers]
        out = {}

        def grade() -> None:
            out["rewards"], out["stats"] = v.score(responses, answers)

        grader = threading.Thread(target=grade)
        grader.start()
        time.sleep(0.5)  # every worker has a pair in flight
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            for pid in pids:
                os.kill(pid, sig)
        grader.join(timeout=60)
        assert out["rewards"] == [1.0, 0.0, 1.0, 1.0]
        assert out["stats"]["reward/worker_failures"] == 0
        assert [w.proc.pid for w in v._workers] == pids and all(w.proc.poll() is None for w in v._workers)
