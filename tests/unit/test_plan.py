"""The memory plan (bapo/plan/, its command line bapo/entry/plan.py): its arithmetic by hand for paper_7b, the
shipped placements fit, its per-token figures against peaks measured on CPU, its knobs, and ``train.py --plan``."""

import dataclasses
import os
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # --record, run as a script from the repository
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bapo.entry import plan as P  # noqa: E402
from bapo.plan.memory import held_snapshots  # noqa: E402
from bapo.plan.verdict import USABLE, make_plan  # noqa: E402
from tests.helpers.config import compose  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.plan import GiB

MiB = 2**20

MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml") if "override /placement" in p.read_text())


def test_paper_7b_on_80gb_by_hand():
    p = P.plan_for(["experiment=paper_7b"])
    # DeepSeek-R1-Distill-Qwen-7B (Qwen2 shape): H = 3584, I = 18944, 28 layers, 28 heads, 4 KV heads of 128.
    # A layer: q 3584^2 + 3584 (bias) = 12,848,640; k, v 3584 x 512 + 512 = 1,835,520 each; o 3584^2 =
    # 12,845,056; MLP 3 x 3584 x 18944 = 203,685,888; two norms 7,168: 233,057,792.
    # Root: untied embedding and LM head 2 x 152,064 x 3584 = 1,089,994,752, final norm 3584: 1,089,998,336.
    # N = 28 x 233,057,792 + 1,089,998,336 = 7,615,616,512.
    s = p.setup.shape
    assert (s.layer_params, s.root_params, s.params) == (233_057_792, 1_089_998_336, 7_615_616_512)
    N, W, K, V = 7_615_616_512, 8, 16384, 152064
    assert (p.setup.world, p.setup.device, p.setup.tokens, p.setup.seq) == (8, 80 * GiB, K, 1024 + 8192)

    items = {i.what.split(" (")[0]: i.bytes for m in p.update for i in m.items}
    assert items["learner: fp32 master weights"] == 4 * N // W == 3_807_808_256
    assert items["learner: fp32 gradients"] == 3_807_808_256
    assert items["learner: AdamW moments, 2 x fp32"] == 8 * N // W == 7_615_616_512
    assert items["learner: bf16 root params, unsharded"] == 2 * 1_089_998_336
    assert items["learner: bf16 params of 2 decoder layers"] == 4 * 233_057_792
    assert items["activations: 28 layers x 7.0 KiB/token"] == 28 * 2 * 3584 * K  # a bf16 input per layer: 3.06 GiB
    # final norm: fp32 input 4H, 1/rms 4, bf16 output 2H; LM head input 2H: 8 x 3584 + 4 = 28,676 bytes a token
    assert items["activations: final norm, LM head input"] == 28_676 * K
    # shared-prompt rows of 9216 tokens: 2 rows for 16384 tokens, a bool mask and a bf16 bias each
    assert items["attention mask of shared-prompt packing"] == 2 * 9216**2 * 3
    # two bf16 [K, V] (logits, gradient) and 196 rows of workspace (256 MiB // (152,064 x 9 bytes))
    assert items["logits chain: bf16 logits, their gradient, one chunk"] == 2 * K * V * 2 + 196 * V * 9
    chain_moment = 3_807_808_256 * 2 + 7_615_616_512 + 2 * 1_089_998_336 + 4 * 233_057_792
    chain_moment += 28 * 7168 * K + 28_676 * K + 2 * 9216**2 * 3 + (2 * K * V * 2 + 196 * V * 9) + int(1.5 * GiB)
    assert p.update_peak.name == "update, at the logits chain's backward"
    assert p.update_peak.total == chain_moment  # 32.1 GiB: vLLM asleep frees its CUDA graphs' pool too

    # generation: masters + AdamW stay, 0.7 x 80 GiB for vLLM (its CUDA graphs inside), 1.5 GiB of context, NCCL
    assert p.generation.total == 3_807_808_256 + 7_615_616_512 + int(0.7 * 80 * GiB) + int(1.5 * GiB)
    e = p.engine
    assert e.weights == 2 * N and e.graphs == GiB
    # vLLM's activations: 16384 tokens x (3 x 18944 + 3 x 3584) x 2 bytes = 2,214,592,512 (> sampling's
    # 1024 x 152,064 x 12 = 1,868,562,432), plus 0.5 GiB non-torch
    assert e.own == 2_214_592_512 + GiB // 2
    # KV: 2 (K and V) x 28 layers x 4 heads x 128 x 2 bytes = 57,344 bytes a token; vLLM 0.32 profiles its CUDA
    # graphs (1 GiB) inside the share before sizing the KV cache
    assert e.kv_tokens == (int(0.7 * 80 * GiB) - 2 * N - e.own - GiB) // 57_344 == 716_258  # 77 sequences of 9216
    assert p.startup_free == 80 * GiB - int(1.5 * GiB) - 3_807_808_256 and p.startup_ok

    host = {i.what.split(":")[0]: i.bytes for i in p.host}
    assert host["vLLM asleep, level 1"] == 8 * 2 * N  # 113.5 GiB of pinned host memory on the node
    assert host["weight snapshots"] == 0  # sync mode: the engine reads the live weights
    assert host["HF export, rank 0"] == 2 * N  # gathered in the model's bf16, kept by rank 0

    assert p.peak == p.generation.total < 76 * GiB and p.fits  # 68.1 GiB


def test_the_stops_save_is_planned_against_the_grace():
    """paper_7b on 8 x 80 GB: a rank writes its DCP shard of the fp32 masters and both AdamW moments, 3 x 4 N / 8 =
    11.42 GB (10.64 GiB), and no snapshot (sync); a node 8 of them, 91.4 GB: 91 s at the assumed 1 GB/s a node,
    beyond SLURM's default KillWait of 30 s, within the launcher's 120 s."""
    N = 7_615_616_512
    p = P.plan_for(["experiment=paper_7b"])
    assert p.save_bytes() == (3 * 4 * N // 8, 8 * (3 * 4 * N // 8))
    lines = "\n".join(p.save_lines())
    assert "10.6 GiB a rank, 85.1 GiB a node; about 91 s" in lines
    assert "launcher.grace_s = 120 s: enough" in lines
    assert "SLURM's default KillWait = 30 s: TOO SHORT" in lines and "--signal=B:TERM@212" in lines
    short = P.plan_for(["experiment=paper_7b", "launcher.grace_s=60"])
    assert "launcher.grace_s = 60 s: TOO SHORT" in "\n".join(short.save_lines())
    over = ["train.async_rollout=true", "buffer.max_staleness=4", "rollout.enable_sleep_mode=false"]
    async_ = P.plan_for(["experiment=paper_7b", *over])
    held = held_snapshots(async_.setup.rc)
    assert held >= 1 and async_.save_bytes()[1] == 8 * (3 * 4 * N // 8) + held * 4 * N  # rank 0's snapshots


@pytest.mark.parametrize("model", MODELS)
def test_every_gpu_model_config_fits_its_placement(model):
    p = P.plan_for([f"model={model}"])
    assert p.fits, p.render(f"model={model}")
    assert p.engine.kv_tokens >= 32 * p.setup.seq  # the KV cache holds a useful batch of full-length sequences


@pytest.mark.parametrize("placement", ["gpu_node", "gpu_node_h200"])
def test_paper_7b_fits_each_node_placement(placement):
    p = P.plan_for(["experiment=paper_7b", f"placement={placement}"])
    assert p.fits and p.peak < p.setup.rc.placement.gpu_memory_gib * USABLE * GiB
    assert p.setup.tokens >= p.setup.seq  # a micro-batch holds the longest sequence


def test_h200_placement_uses_its_larger_memory():
    small, large = P.plan_for(["experiment=paper_7b"]), P.plan_for(["experiment=paper_7b", "placement=gpu_node_h200"])
    assert large.setup.device == 139 * GiB
    assert large.engine.kv_tokens > 2 * small.engine.kv_tokens and large.setup.tokens == 2 * small.setup.tokens


def test_world_size_from_option_then_env_then_placement(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert P.plan_for(["experiment=paper_7b"]).setup.world == 8
    monkeypatch.setenv("WORLD_SIZE", "16")
    p16 = P.plan_for(["experiment=paper_7b"])
    assert p16.setup.world == 16 and os.environ["WORLD_SIZE"] == "16"
    assert P.plan_for(["experiment=paper_7b"], nproc=32).setup.world == 32
    masters = {p.setup.world: p.generation.items[0].bytes for p in (p16, P.plan_for(["experiment=paper_7b"], nproc=32))}
    assert masters[16] == 2 * masters[32] == 4 * 7_615_616_512 // 16


def test_kl_reference_async_snapshots_offload_and_sleep_level():
    base = ["experiment=paper_7b"]
    kl = P.plan_for([*base, "algo.kl_coef=0.01"])
    ref = 2 * 7_615_616_512 // 8  # a sharded bf16 copy
    assert kl.generation.total == P.plan_for(base).generation.total + ref
    assert any(m.name == "update, at the KL reference's forward" for m in kl.update)

    rc = P.plan_for(base).setup.rc
    async_rc = dataclasses.replace(
        rc,
        train=dataclasses.replace(rc.train, async_rollout=True),
        learner=dataclasses.replace(rc.learner, old_logp="recompute"),
        buffer=dataclasses.replace(rc.buffer, max_staleness=8),
    )
    snaps = next(i for i in make_plan(async_rc, world=8).host if i.what.startswith("weight snapshots"))
    assert snaps.bytes == 3 * 8 * 7_615_616_512 * 4  # 8 // 4 updates a batch + 1 = 3 versions, 8 ranks, fp32

    p = P.plan_for(["model=r1_distill_qwen_32b"])
    assert p.generation.items[0].bytes == 0  # offloaded: nothing of the learner's state on the GPU
    offload = next(i for i in p.host if i.what.startswith("FSDP CPU offload"))
    assert offload.bytes == 16 * p.setup.shape.params  # the whole node's shards
    rc = p.setup.rc
    rc.rollout.sleep_level = 2  # discards its weights instead of copying them to the host
    asleep = next(i for i in make_plan(rc, world=8).host if i.what.startswith("vLLM asleep"))
    assert asleep.bytes == 0


def test_knobs_name_the_number_that_fits():
    big = ["experiment=paper_7b", "learner.max_tokens_per_micro_batch=200000"]
    p = P.plan_for(big)
    assert not p.fits and p.update_peak.total > p.limit
    (knob,) = [a for a in p.advice() if a.startswith("learner.max_tokens_per_micro_batch=")]
    tokens = int(knob.split("=")[1].split()[0])
    assert P.plan_for([*big[:1], f"learner.max_tokens_per_micro_batch={tokens}"]).update_peak.total <= p.limit
    assert P.plan_for([*big[:1], f"learner.max_tokens_per_micro_batch={tokens + 64}"]).update_peak.total > p.limit

    greedy = ["experiment=paper_7b", "rollout.gpu_memory_utilization=0.95"]
    p = P.plan_for(greedy)
    assert not p.fits and p.generation.total > p.limit
    (knob,) = [a for a in p.advice() if a.startswith("rollout.gpu_memory_utilization=")]
    util = float(knob.split("=")[1].split()[0])
    assert util == 0.79 and P.plan_for([*greedy[:1], f"rollout.gpu_memory_utilization={util}"]).fits
    assert not P.plan_for([*greedy[:1], "rollout.gpu_memory_utilization=0.80"]).fits

    p = P.plan_for(["experiment=paper_7b", "learner.activation_checkpointing=false"])
    assert not p.fits and "  learner.activation_checkpointing=true" in p.advice()


def test_vllm_start_up_check_is_planned():
    # 0.95 x 80 GiB = 76.0 GiB > 80 - 1.5 - 3.55 (the learner's masters) = 74.95 GiB free when vLLM starts
    p = P.plan_for(["experiment=paper_7b", "rollout.gpu_memory_utilization=0.95"])
    assert not p.startup_ok and not p.fits
    assert "REFUSED" in p.render()


# ----------------------------------------------------------------------------- the command line


def test_cli_exit_status_says_whether_it_fits(capsys):
    assert P.cli(["experiment=paper_7b"]) == 0
    assert P.cli(["experiment=paper_7b", "--gpu-memory", "40"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "rollout.gpu_memory_utilization=" in out
    assert P.cli(["experiment=paper_7b", "no_such_group=1"]) == 2
    assert "error: " in capsys.readouterr().err


def test_plan_composes_what_training_composes():
    from omegaconf import OmegaConf

    cfg = P.compose(["experiment=paper_7b"])
    assert OmegaConf.to_container(cfg) == OmegaConf.to_container(compose("experiment=paper_7b"))
    assert cfg.placement.name == "gpu_node" and cfg.model.name_or_path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"


# ----------------------------------------------------------------------------- the split: servers on GPUs of their own


def test_the_split_plans_learner_ranks_server_gpus_and_staging_by_hand():
    """`experiment=paper_7b placement=gpu_node_split`: 8 GPUs, 4 of them the servers' (rollout.gpus), so 4 learner
    ranks hold 1/4 of the learner's state each; a server's GPU holds vLLM's 0.9 share alone."""
    N = 7_615_616_512
    p = P.plan_for(["experiment=paper_7b", "placement=gpu_node_split"])
    assert p.setup.world == 4 and p.setup.server_gpus == 4
    items = {i.what.split(" (")[0]: i.bytes for m in p.update for i in m.items}
    assert items["learner: fp32 master weights"] == 4 * N // 4  # twice the colocated 8-rank share
    assert "vLLM" not in " ".join(items)  # nothing of vLLM on a learner's GPU
    assert p.generation.name.startswith("a server's GPU") and p.generation.total == int(0.9 * 80 * GiB)
    e = p.engine
    assert e.kv_tokens == (int(0.9 * 80 * GiB) - 2 * N - e.own - GiB) // 57_344
    assert p.startup_free == 80 * GiB and p.startup_ok
    host = {i.what.split(":")[0]: i.bytes for i in p.host}
    assert host["servers' staged weights in /dev/shm"] == 2 * N  # sync: one copy a node
    assert host["weight staging"] == 32 * MiB  # the node's writer streams a 32 MiB chunk at a time
    assert not any("staging" in i.what for m in p.update for i in m.items)  # sync: staging waits for the update
    assert p.fits and p.peak == p.generation.total

    asynchronous = P.plan_for(["experiment=paper_7b", "placement=gpu_node_split", "train.async_rollout=true"])
    host = {i.what.split(":")[0]: i.bytes for i in asynchronous.host}
    assert host["servers' staged weights in /dev/shm"] == 4 * 2 * N  # one copy a server
    assert host["weight snapshots"] == 2 * 4 * 4 * N  # 4 // 4 + 1 = 2 versions x 4 ranks, fp32 (paper_7b recomputes)
    assert host["weight staging"] == 4 * 32 * MiB  # every rank stages its own snapshot, a chunk at a time
    # beside the update, a snapshot's chunk on the learner's GPU: the fp32 chunk, its bf16 cast, its words' squares
    staging = [i.bytes for m in asynchronous.update for i in m.items if i.what.startswith("weight staging")]
    assert staging == [96 * MiB] * len(asynchronous.update)
    # servers given by URL live elsewhere: all 8 GPUs train, nothing staged on this node's tmpfs by servers here
    remote = P.plan_for(["experiment=paper_7b", "placement=gpu_node_split", "rollout.url='http://a:1'"], nproc=1)
    assert remote.setup.server_gpus == 0 and not any("staged" in i.what for i in remote.host)


def test_a_micro_batch_holds_the_longest_sequence():
    """The learner never splits a sequence: a token budget under one sequence is planned at that sequence."""
    p = P.plan_for(["experiment=paper_7b", "learner.max_tokens_per_micro_batch=4096"])
    assert p.setup.tokens == p.setup.seq == 9216


def test_the_plan_refuses_what_the_launch_refuses():
    from bapo.config import ConfigError
    from bapo.engines.vllm import check_tensor_parallel

    with pytest.raises(ConfigError) as launch:
        check_tensor_parallel(4, 2)
    with pytest.raises(ConfigError) as planned:
        P.plan_for(["model=r1_distill_qwen_32b"], nproc=2)
    assert str(planned.value) == str(launch.value) and "tensor_parallel_size: 4 must divide" in str(launch.value)
    P.plan_for(["model=r1_distill_qwen_32b"], nproc=4)  # 4 ranks: one engine of 4


GPU_MODELS = [*MODELS, "experiment=paper_7b"]
PLACEMENTS = sorted(p.stem for p in (ROOT / "conf" / "placement").glob("*.yaml"))


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_plans_every_gpu_model(placement):
    """`--plan` for every shipped placement x GPU model config: a plan, or a one-line refusal of the combination
    (never a traceback; what does not fit names a knob)."""
    from bapo.config import ConfigError

    for model in GPU_MODELS:
        over = [model if "=" in model else f"model={model}", f"placement={placement}"]
        try:
            p = P.plan_for(over)
        except ConfigError as e:
            assert "\n" not in str(e), over
            continue
        text = p.render(" ".join(over))
        assert p.fits or any("=" in a for a in p.advice()), text  # what does not fit names the key to turn


@pytest.mark.parametrize(
    "args, says",
    [
        (["--gpu-memory", "nan"], "--gpu-memory must be a positive number of GiB, got 'nan'"),
        (["--gpu-memory", "-5"], "--gpu-memory must be a positive number of GiB, got '-5'"),
        (["--gpu-memory", "0"], "--gpu-memory must be a positive number of GiB, got '0'"),
        (["--host-memory", "inf"], "--host-memory must be a positive number of GiB, got 'inf'"),
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--nproc", "two"], "--nproc must be a whole number of ranks"),
        (["model.arch.hidden_size=0"], "model.arch.hidden_size: must be >= 1, got 0"),
        (["model.arch.num_hidden_layers=-4"], "model.arch.num_hidden_layers: must be >= 1, got -4"),
        (["--cfg", "job"], "unknown option(s) ['--cfg']"),
    ],
)
def test_bad_plan_input_is_one_line_and_exit_2(capsys, args, says):
    try:
        status = P.cli(["experiment=paper_7b", *args])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, err


# ----------------------------------------------------------------------------- docs/gpu.md, generated here

DOC = ROOT / "docs" / "gpu.md"
DOC_PLANS = {  # the plans docs/gpu.md prints in full, each in a ``` block that starts with its "memory plan:" line
    "experiment=paper_7b": ["experiment=paper_7b"],
    "experiment=paper_7b placement=gpu_node_split": ["experiment=paper_7b", "placement=gpu_node_split"],
}
TABLE = [  # (the command column, overrides), in the order of docs/gpu.md's table of shipped placements
    ("`model=qwen2.5_0.5b`", ["model=qwen2.5_0.5b"]),
    ("`model=qwen2.5_1.5b`", ["model=qwen2.5_1.5b"]),
    ("`model=qwen2.5_7b`, `qwen7b`", ["model=qwen2.5_7b"]),
    ("`model=qwen2.5_math_7b`", ["model=qwen2.5_math_7b"]),
    ("`model=r1_distill_qwen_7b`, `experiment=paper_7b`", ["experiment=paper_7b"]),
    ("`experiment=paper_7b placement=gpu_node_h200`", ["experiment=paper_7b", "placement=gpu_node_h200"]),
    ("`experiment=paper_7b placement=gpu_node_split`", ["experiment=paper_7b", "placement=gpu_node_split"]),
    ("`model=r1_distill_qwen_32b`", ["model=r1_distill_qwen_32b"]),
]


def table_row(label: str, over: list[str]) -> str:
    p = P.plan_for(over)
    u, r, ln = p.setup, p.setup.rc.rollout, p.setup.rc.learner
    place = u.rc.placement.name + (
        f" ({u.rc.placement.gpu_memory_gib:g} GiB)" if u.rc.placement.gpu_memory_gib != 80 else ""
    )
    gpus = f"{u.world} + {u.server_gpus} servers" if u.server else f"{u.world}"
    cells = [
        label, f"`{place}`", gpus, f"{r.max_new_tokens}", f"{r.gpu_memory_utilization:g}", f"{r.tensor_parallel_size}",
        f"{u.tokens}", "yes" if ln.cpu_offload else "no", f"{p.generation.total / GiB:.1f}",
        f"{p.update_peak.total / GiB:.1f}", f"{p.engine.kv_tokens // u.seq}", f"{p.host_total / GiB:.0f}",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def expected_docs() -> dict[str, str]:
    out = {label: P.plan_for(over).render(label) for label, over in DOC_PLANS.items()}
    out["table"] = "\n".join(table_row(label, over) for label, over in TABLE)
    return out


def _doc_blocks(text: str) -> dict[str, str]:
    blocks = {}
    for block in text.split("```\n")[1::2]:
        if block.startswith("memory plan: "):
            blocks[block.splitlines()[0].removeprefix("memory plan: ")] = block.rstrip("\n")
    rows = [ln for ln in text.splitlines() if ln.startswith("| `") and "|" in ln[3:] and ln.count("|") == 13]
    blocks["table"] = "\n".join(rows)
    return blocks


@pytest.mark.skipif("WORLD_SIZE" in os.environ, reason="the documented plans assume the placement's ranks")
def test_the_plans_in_docs_gpu_md_are_the_plans_of_today():
    """docs/gpu.md prints plans and a table of the shipped placements; they are regenerated here, so they cannot go
    stale: after a change to bapo/plan/, `python tests/unit/test_plan.py --record` rewrites them."""
    have, want = _doc_blocks(DOC.read_text()), expected_docs()
    for key, text in want.items():
        assert have.get(key) == text, (
            f"docs/gpu.md: the {key!r} plan is stale; run python tests/unit/test_plan.py --record"
        )


def _record() -> None:
    text = DOC.read_text()
    have = _doc_blocks(text)
    for key, new in expected_docs().items():
        text = text.replace(have[key], new)
    DOC.write_text(text)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:  # python tests/unit/test_plan.py --record
    _record()
