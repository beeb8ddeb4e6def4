"""Per-token data as tensors (after) against Python tuples of numbers (before), on a paper_7b-sized step.

A paper_7b step is 256 prompts x 16 responses = 4096 samples with responses of up to 8192
tokens (lengths drawn uniformly in [1, 8192] with a fixed seed: about 16.8M response tokens)
and prompts of about 200 tokens. Every sample carries its token ids and behaviour log-probs
(with ``--critic`` also per-token advantages, old values and returns, as PPO with a critic
does). Both representations of the same numbers go through the four places where per-token
data is bulk-handled, each timed once:

- collate: ``bapo.learner.batching.collate`` (tensors) against the legacy collate below, which
  is what the code did with tuples: ``torch.tensor(tuple)`` per row and field;
- gather (2 ranks): 2 gloo processes (forked, with torchrun's variables, 1 torch thread each) gather
  their rollout shares: ``bapo.rollout.maker.gather_batch`` (flat tensors) against
  ``torch.distributed.all_gather_object`` of the tuple-based share (pickled Python objects);
  the time of a stage is its slower rank's;
- checkpoint write / read: ``bapo.checkpoint.write`` and ``load`` of a replay-buffer-shaped
  state against ``torch.save`` of the same structure with tuples, read back with
  ``torch.load(weights_only=True)`` (the old ``write``). Neither side checks a manifest here:
  checksums cost the same for both and are not what changed.

The before path is slow at full scale (tens of millions of boxed numbers through ``to_plain``, pickle
and the pure-Python ``weights_only`` unpickler): on the 2-core machine scale 1.0 takes about 5.5
minutes in all, 4 of them in the before path, and 3.5 GiB here plus 3 GiB per rank; with
``--critic`` the before path takes about twice as long. ``--before-scale`` times it on fewer
prompts; ratios are then taken at that equal scale and the after path is timed at ``--scale`` as
well (both printed). A scale whose estimated peak memory does not fit is lowered to the largest
that does, with a note.

The script also checks that both paths produce the same numbers (collated batches, gathered
batches, checkpoint round trips) and exits 1 if any differs; ``--dump`` writes rank 0's gathered
batches (before, after and the source) for an outside check.

    python scripts/bench/bench_batchio.py [--scale 1.0] [--before-scale S] [--critic] [--quick] [--dump FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from bapo import checkpoint  # noqa: E402
from bapo.infra import dist
from bapo.learner.batching import TOKEN_EXTRAS, collate  # noqa: E402
from bapo.rollout.maker import gather_batch, merge_stats  # noqa: E402
from bapo.samples import Problem, Prompt, RolloutBatch, Sample, ScoredSample, TrainBatch  # noqa: E402
from scripts.bench.harness import timed  # noqa: E402

VOCAB = 151_643  # Qwen2.5's: ids need 18 bits, so as Python ints they are real objects, not cached small ints
PAD = 0
VERSION = 7
PER_TOKEN = ("response_ids", "logp")  # Sample's per-token fields; ScoredSample's are TOKEN_EXTRAS + token_adv
SCORED_PER_TOKEN = ("token_adv", *TOKEN_EXTRAS)
STAGES = ("collate", "gather (2 ranks)", "checkpoint write", "checkpoint read")
# Peak resident memory of the whole run per response token, with and without --critic, from runs at scale 1
# (2 ranks of 3.0 GiB; this process 3.5 GiB) and 0.25 (this process ~590 B a token with --critic), plus a margin.
# This process keeps both collated batches for the identity check; a rank holds a whole gathered batch in each
# representation (the critic's fields are not gathered).
BYTES_PER_TOKEN = {False: 400, True: 650}


@dataclasses.dataclass(frozen=True)
class Shape:
    prompts: int
    responses: int  # per prompt
    max_tokens: int  # response lengths are uniform in [1, max_tokens]
    prompt_tokens: int  # prompt lengths are uniform in [3/4, 5/4] of this

    def scaled(self, scale: float) -> Shape:
        """The same step on ``scale`` times the prompts (at least 2: one per rank)."""
        return dataclasses.replace(self, prompts=max(2, round(self.prompts * scale)))

    def describe(self, tokens: int | None = None) -> str:
        n = self.prompts * self.responses
        count = f"~{round(n * (self.max_tokens + 1) / 2):,} tokens expected" if tokens is None else f"{tokens:,} tokens"
        return (
            f"{self.prompts} prompts x {self.responses} responses = {n} samples, response lengths uniform in "
            f"[1, {self.max_tokens}] ({count}), prompts ~{self.prompt_tokens} tokens"
        )


PAPER = Shape(prompts=256, responses=16, max_tokens=8192, prompt_tokens=200)
QUICK = Shape(prompts=4, responses=4, max_tokens=300, prompt_tokens=24)


# ----------------------------------------------------------------------------- the data


def make_step(shape: Shape, *, critic: bool, seed: int = 0) -> tuple[tuple[Prompt, ...], list[ScoredSample]]:
    """One step's prompts and scored samples with tensor fields, the same for a given shape and seed."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(shape.prompts):
        n = int(torch.randint(shape.prompt_tokens * 3 // 4, shape.prompt_tokens * 5 // 4 + 1, (1,), generator=g))
        ids = tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist())
        prompts.append(Prompt(Problem(f"p{i}", f"problem {i}", str(i)), f"<prompt {i}>", ids))
    pool = "".join(chr(c) for c in torch.randint(97, 123, (4 * shape.max_tokens + 100,), generator=g).tolist())
    lengths = torch.randint(1, shape.max_tokens + 1, (shape.prompts * shape.responses,), generator=g)  # [n]
    scored = []
    for i, n in enumerate(lengths.tolist()):
        group = i // shape.responses
        # every field its own tensor, as in a real sample (views would share one storage, which torch.save writes once)
        sample = Sample(
            prompt=prompts[group],
            group=group,
            response_ids=torch.randint(0, VOCAB, (n,), generator=g),  # [T] int64
            logp=-torch.empty(n).exponential_(generator=g),  # [T] float32
            text=pool[i % 97 : i % 97 + n * 7 // 2] + " ∎",  # ~3.5 bytes a token, not all ASCII
            version=VERSION,
            truncated=n == shape.max_tokens,
        )
        extras = {k: torch.randn(n, generator=g) for k in SCORED_PER_TOKEN} if critic else {}
        reward = float(i % 3 == 0)
        extracted = None if i % 4 == 1 else str(i % 10)
        scored.append(ScoredSample(sample, reward, reward - 1 / 3, reward > 0, extracted, **extras))
    return tuple(prompts), scored


def _tup(x: torch.Tensor | None) -> tuple | None:
    return None if x is None else tuple(x.tolist())  # float32 -> Python float is exact


def as_tuples(scored: list[ScoredSample]) -> list[ScoredSample]:
    """The same samples as the code held them before: per-token fields as tuples of Python numbers."""
    out = []
    for s in scored:
        sample = dataclasses.replace(s.sample, **{k: _tup(getattr(s.sample, k)) for k in PER_TOKEN})
        out.append(dataclasses.replace(s, sample=sample, **{k: _tup(getattr(s, k)) for k in SCORED_PER_TOKEN}))
    return out


def buffer_state(scored: list[ScoredSample], responses: int) -> dict:
    """A checkpoint state shaped like the replay buffer's (``Buffer.state_dict``): the step's groups."""
    groups = [scored[i : i + responses] for i in range(0, len(scored), responses)]
    return {"buffer": {"groups": groups, "rng": random.Random(0).getstate(), "counters": (0, 0, 0)}}


def _same(x, y) -> bool:
    """Equal per-token data, whatever the representation (tuple or tensor; None only against None)."""
    if x is None or y is None:
        return x is None and y is None
    return torch.equal(torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64))


def same_sample(a: Sample, b: Sample) -> bool:
    plain = ("group", "text", "version", "truncated")
    return (
        a.prompt == b.prompt
        and all(getattr(a, k) == getattr(b, k) for k in plain)
        and all(_same(getattr(a, k), getattr(b, k)) for k in PER_TOKEN)
    )


def same_scored(a: list[ScoredSample], b: list[ScoredSample]) -> bool:
    plain = ("reward", "advantage", "correct", "extracted")
    return len(a) == len(b) and all(
        same_sample(x.sample, y.sample)
        and all(getattr(x, k) == getattr(y, k) for k in plain)
        and all(_same(getattr(x, k), getattr(y, k)) for k in SCORED_PER_TOKEN)
        for x, y in zip(a, b, strict=True)
    )


def same_batch(a: TrainBatch, b: TrainBatch) -> bool:
    fields = ("input_ids", "attention_mask", "mask", "old_logp", "adv", "versions")
    return (
        all(torch.equal(getattr(a, k), getattr(b, k)) for k in fields)
        and a.extras.keys() == b.extras.keys()
        and all(torch.equal(a.extras[k], b.extras[k]) for k in a.extras)
    )


# ----------------------------------------------------------------------------- the before path


def legacy_collate(samples: list[ScoredSample], *, pad_id: int) -> TrainBatch:
    """Collate as the tuple-based code did: each row built as a Python list and converted by torch.tensor."""
    plain = [s.sample for s in samples]
    rows = [list(s.prompt.ids) + list(s.response_ids) for s in plain]
    B, L = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    mask, old_logp, adv = torch.zeros((B, L - 1)), torch.zeros((B, L - 1)), torch.zeros((B, L - 1))
    names = [k for k in TOKEN_EXTRAS if any(getattr(s, k) is not None for s in samples)]
    extras = {k: torch.zeros((B, L - 1)) for k in names}
    for b, (sc, s, row) in enumerate(zip(samples, plain, rows, strict=True)):
        p, r = len(s.prompt.ids), len(s.response_ids)
        input_ids[b, : len(row)] = torch.tensor(row)
        attention_mask[b, : len(row)] = 1
        sl = slice(p - 1, p - 1 + r)  # response token j sits at p+j and is predicted at p+j-1
        mask[b, sl] = 1.0
        old_logp[b, sl] = torch.tensor(s.logp, dtype=torch.float)
        adv[b, sl] = torch.tensor(sc.token_adv) if sc.token_adv is not None else sc.advantage
        for k in names:
            extras[k][b, sl] = torch.tensor(getattr(sc, k), dtype=torch.float)
    versions = torch.tensor([s.version for s in plain], dtype=torch.long)
    return TrainBatch(input_ids, attention_mask, mask, old_logp, adv, versions, extras)


def legacy_write(path: Path, state: dict) -> None:
    with open(path, "wb") as f:
        torch.save(checkpoint.to_plain(state), f)
        f.flush()
        os.fsync(f.fileno())


def legacy_read(path: Path) -> dict:
    return checkpoint.from_plain(torch.load(path, map_location="cpu", weights_only=True))


def legacy_gather(mine: RolloutBatch) -> RolloutBatch:
    """Every rank's share pickled whole through all_gather_object, then concatenated in rank order."""
    parts = dist.all_gather_object(mine)
    if any((p.index, p.version) != (mine.index, mine.version) for p in parts):
        raise RuntimeError("ranks produced different rollout batches")
    stats = merge_stats([p.stats for p in parts])
    correct = tuple(c for p in parts for c in p.correct)
    stats["reward/accuracy"] = sum(correct) / max(len(correct), 1)
    return RolloutBatch(
        mine.index,
        mine.version,
        tuple(s for p in parts for s in p.samples),
        tuple(r for p in parts for r in p.rewards),
        correct,
        tuple(x for p in parts for x in p.extracted),
        stats,
    )


def _load(path: Path) -> dict:
    return checkpoint.load(path, verify_checksum=False)  # a lone file: no manifest (see the module docstring)


LOCAL = {  # path: its collate, checkpoint write and checkpoint read
    "before": (legacy_collate, legacy_write, legacy_read),
    "after": (collate, checkpoint.write, _load),
}


def run_local(shape: Shape, *, critic: bool, tmp: Path, paths: tuple[str, ...]) -> dict:
    """Collate and checkpoint write/read of one step on each path; seconds, bytes and identity checks."""
    _, source = make_step(shape, critic=critic)
    res: dict = {"checks": {}, "tokens": sum(len(s.sample.response_ids) for s in source)}
    batches = {}
    for path in paths:
        scored = source if path == "after" else as_tuples(source)
        coll, write, read = LOCAL[path]
        t_coll, batches[path] = timed(coll, scored, pad_id=PAD)
        f = tmp / f"{path}-{shape.prompts}.pt"
        t_write, _ = timed(write, f, buffer_state(scored, shape.responses))
        del scored
        t_read, state = timed(read, f)
        loaded = [s for g in state["buffer"]["groups"] for s in g]
        res[path] = {"collate": t_coll, "checkpoint write": t_write, "checkpoint read": t_read}
        res[path]["bytes"] = f.stat().st_size
        res["checks"][f"checkpoint round trip ({path})"] = same_scored(loaded, source)
        del state, loaded
        f.unlink()
    if len(batches) == 2:
        res["checks"]["collated batches identical"] = same_batch(batches["before"], batches["after"])
    return res


def share(prompts: tuple[Prompt, ...], scored: list[ScoredSample], *, legacy: bool) -> RolloutBatch:
    """This rank's share of the step (prompts rank, rank + world, ...), as the rollout maker hands it over."""
    r, w = dist.rank(), dist.world_size()
    mine = [s for s in scored if s.sample.group % w == r]
    if legacy:
        mine = as_tuples(mine)
    n_tok = sum(len(s.sample.response_ids) for s in mine)
    stats = {"time/rollout_s": 10.0 + r, "rollout/tokens_per_s": n_tok / 10.0, "reward/mean": 1 / 3}
    rewards, correct = tuple(s.reward for s in mine), tuple(s.correct for s in mine)
    # the old RolloutBatch had no prompts field: each pickled sample carried its own prompt
    return RolloutBatch(1, VERSION, tuple(s.sample for s in mine), rewards, correct,
                        tuple(s.extracted for s in mine), stats, () if legacy else prompts)  # fmt: skip


def same_gathered(batch: RolloutBatch, source: list[ScoredSample]) -> bool:
    return (
        len(batch.samples) == len(source)
        and all(same_sample(a, b.sample) for a, b in zip(batch.samples, source, strict=True))
        and batch.rewards == tuple(s.reward for s in source)
        and batch.correct == tuple(s.correct for s in source)
        and batch.extracted == tuple(s.extracted for s in source)
    )


def flat(samples) -> dict:
    """Gathered samples as flat tensors (the ``--dump`` format): lengths, groups, token ids, log-probs, texts."""
    return {
        "lengths": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long),
        "groups": torch.tensor([s.group for s in samples], dtype=torch.long),
        "tokens": torch.cat([torch.as_tensor(s.response_ids, dtype=torch.long) for s in samples]),
        "logp": torch.cat([torch.as_tensor(s.logp, dtype=torch.float64) for s in samples]),
        "texts": [s.text for s in samples],
    }


def worker(rank: int, env: dict, spec: dict) -> None:
    """One gloo rank: gather the step's shares on each path, time the slower rank, check both give the source."""
    os.environ.update(env | {"RANK": str(rank), "LOCAL_RANK": str(rank)})  # what torchrun would set
    torch.set_num_threads(1)
    dist.init("gloo", timeout_s=900.0)
    out = []
    for job in spec["jobs"]:
        shape = Shape(*job["shape"])
        prompts, scored = make_step(shape, critic=spec["critic"])
        source = [s for r in range(dist.world_size()) for s in scored if s.sample.group % dist.world_size() == r]
        res: dict = {"checks": {}}
        gathered = {}
        for path in job["paths"]:
            mine = share(prompts, scored, legacy=path == "before")
            dist.barrier()
            t0 = time.perf_counter()
            gathered[path] = legacy_gather(mine) if path == "before" else gather_batch(mine, dist.world_size())
            t = time.perf_counter() - t0
            res[path] = {"gather (2 ranks)": float(dist.reduce_max(torch.tensor([t], dtype=torch.float64)))}
            ok = torch.tensor([float(same_gathered(gathered[path], source))])
            res["checks"][f"gathered batch == source ({path})"] = bool(-dist.reduce_max(-ok) > 0)  # on all ranks
            del mine
        res["maxrss_kb"] = int(dist.reduce_max(torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss])))
        if spec.get("dump") and dist.rank() == 0 and len(gathered) == 2:
            dump = {"source": flat([s.sample for s in source])}
            dump |= {path: flat(b.samples) for path, b in gathered.items()}
            torch.save(dump, spec["dump"])
        out.append(res)
        del gathered, scored, source
    if dist.rank() == 0:
        Path(spec["result"]).write_text(json.dumps(out))
    dist.teardown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gather(jobs: list[dict], *, critic: bool, tmp: Path, dump: str | None) -> list[dict]:
    """Run 2 gloo ranks (forked: torch is already imported; 1 thread each, torchrun's variables) and return
    rank 0's results. Called before this process has touched any data or started any thread pool."""
    result = tmp / "gather.json"
    spec = {"jobs": jobs, "critic": critic, "result": str(result), "dump": dump}
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=worker, args=(r, env, spec)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        while any(p.exitcode is None for p in procs):  # a rank that dies leaves the other waiting in a collective
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    if codes != [0, 0]:
        raise RuntimeError(f"gather ranks failed with exit codes {codes} (their output is above)")
    return json.loads(result.read_text())


# ----------------------------------------------------------------------------- main


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); 0 if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fit_scale(shape: Shape, scale: float, critic: bool) -> tuple[float, str]:
    """``scale``, or the largest one whose estimated peak fits in 80% of the available memory (with why)."""
    avail = mem_available()
    per_scale = shape.prompts * shape.responses * (shape.max_tokens + 1) / 2 * BYTES_PER_TOKEN[critic]
    if not avail or per_scale * scale <= 0.8 * avail:
        return scale, ""
    fit = int(0.8 * avail / per_scale * 64) / 64  # a multiple of 1/64: whole prompts at paper size
    why = (
        f"scale {scale:g} needs ~{per_scale * scale / 2**30:.1f} GiB at peak, {avail / 2**30:.1f} GiB available: "
        f"running at scale {fit:g}, the largest that fits"
    )
    return fit, why


def row(name: str, before: float, after: float, unit: str, extra: str = "") -> str:
    fmt = (lambda x: f"{x / 1e6:.4g} MB") if unit == "bytes" else (lambda x: f"{x:.4g}")  # 4 digits at any scale
    return f"{name:<18} | {fmt(before):>10} | {fmt(after):>10} | {f'{before / after:.3g}x':>20}{extra}"


def report(base: Shape, shape_eq: Shape, shape_full: Shape, res_eq: dict, res_full: dict | None) -> bool:
    """Print the table (ratios at equal scale) and the identity checks; True when every check passed."""
    wide = res_full is not None
    head = f"{'stage':<18} | {'before s':>10} | {'after s':>10} | {'ratio (before/after)'}"
    scale_eq, scale_full = shape_eq.prompts / base.prompts, shape_full.prompts / base.prompts
    print(f"\nbefore and after at scale {scale_eq:g}: {shape_eq.describe(res_eq['tokens'])}")
    if wide:
        print(f"after also at scale {scale_full:g}: {shape_full.describe(res_full['tokens'])}")
        head += f" | after s at scale {scale_full:g}"
    print(head)
    for stage in STAGES:
        extra = f" | {res_full['after'][stage]:.4g}" if wide else ""
        print(row(stage, res_eq["before"][stage], res_eq["after"][stage], "s", extra))
    extra = f" | {res_full['after']['bytes'] / 1e6:.4g} MB" if wide else ""
    print(row("checkpoint bytes", res_eq["before"]["bytes"], res_eq["after"]["bytes"], "bytes", extra))
    checks = res_eq["checks"] | (
        {f"{k} at scale {scale_full:g}": v for k, v in res_full["checks"].items()} if wide else {}
    )
    print("checks: " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items()))
    return all(checks.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the paper_7b step's prompts (1.0 = 256)")
    ap.add_argument("--before-scale", type=float, help="time the slow before path at this smaller scale")
    ap.add_argument("--critic", action="store_true", help="also per-token advantages, old values and returns")
    ap.add_argument("--quick", action="store_true", help=f"a tiny step for tests: {QUICK.describe()}")
    ap.add_argument("--dump", help="write rank 0's gathered batches (before, after, source) to this file")
    ap.add_argument("--tmp-dir", help="where the checkpoints are written (default: the system's temp folder)")
    args = ap.parse_args()
    if args.scale <= 0 or (args.before_scale is not None and not 0 < args.before_scale <= args.scale):
        ap.error("--scale must be > 0 and --before-scale in (0, --scale]")
    base = QUICK if args.quick else PAPER
    scale, why = fit_scale(base, args.scale, args.critic)
    full = base.scaled(scale)
    eq = base.scaled(min(scale, args.before_scale or scale))
    fields = ", ".join(PER_TOKEN + (SCORED_PER_TOKEN if args.critic else ()))
    print(f"bench_batchio: per-token data as Python tuples (before) vs tensors (after); per-token fields: {fields}")
    print(f"{'quick step' if args.quick else 'paper_7b step'} at scale {scale:g}: {full.describe()}")
    if why:
        print(f"NOTE: {why}")
    jobs = [{"shape": dataclasses.astuple(eq), "paths": ["before", "after"]}]
    if full != eq:
        jobs.append({"shape": dataclasses.astuple(full), "paths": ["after"]})
    with tempfile.TemporaryDirectory(prefix="bench_batchio-", dir=args.tmp_dir) as d:
        tmp = Path(d)
        gathered = run_gather(jobs, critic=args.critic, tmp=tmp, dump=args.dump)  # first: this process holds nothing
        res_eq = run_local(eq, critic=args.critic, tmp=tmp, paths=("before", "after"))
        res_full = run_local(full, critic=args.critic, tmp=tmp, paths=("after",)) if full != eq else None
    for res, g in zip((res_eq, res_full), gathered, strict=False):
        for path in ("before", "after"):
            if path in g:
                res[path] |= g[path]
        res["checks"] |= g["checks"]
    ok = report(base, eq, full, res_eq, res_full)
    ranks_gb = max(g["maxrss_kb"] for g in gathered) / 2**20
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) here, 1 per gloo rank; peak RSS: "
          f"this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB, "
          f"a gather rank {ranks_gb:.1f} GiB")  # fmt: skip
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
