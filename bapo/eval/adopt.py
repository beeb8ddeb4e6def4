"""A training run evaluated the way it was trained: eval.py's composed config takes the settings of the run (or
export) that ``checkpoint=`` names, unless the command line sets them.

:func:`find_checkpoint` finds the weights and the training config that came with them; :func:`adopt_run` takes
the run's model group, response budget, prompt settings and rollout engine with its knobs into eval.py's config
(an engine that ran on GPUs of its own gives way to the one its traits name for the eval ranks), logs what it
took and what the command line kept, and returns a :class:`RunSettings` for results.json. A run's config is read
as data (``bapo.infra.artifacts``), and ``model.trust_remote_code`` is never taken from it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from bapo.config import ConfigError, engine_traits, resolve_path
from bapo.infra.artifacts import ArtifactError, load_config
from bapo.infra.checks import require
from bapo.infra.paths import EXPORT_CONFIG, compose_option

log = logging.getLogger(__name__)


RUN_CONFIG = "config.yaml"  # a training run folder's resolved config (bapo/loop.py writes it)
SAMPLING = ("engine", "n", "temperature", "max_new_tokens")  # eval.py's own rollout keys (k, temperature, ...)
NOT_FROM_RUN = ("name_or_path", "init", "gguf")  # model keys the checkpoint itself decides
# Keys an artifact never decides: a downloaded run folder or export saying trust_remote_code: true would make
# transformers import the modeling_*.py its config.json's auto_map names. Only the command line turns it on.
NEVER_FROM_RUN = ("trust_remote_code",)
RUN_PLACEMENT = ("url", "gpus")  # where the run's engine ran: its servers, the training node's GPUs


@dataclass
class RunSettings:
    """A checkpoint, and what evaluation took from the training config it carries (if it carries one).

    ``taken``: eval key -> the run's value, applied. ``kept``: eval key -> (the command line's value, the
    run's), where an explicit override won. ``withheld``: eval key -> the run's value, never taken from an
    artifact (:data:`NEVER_FROM_RUN`); the command line's or eval.py's own value applies."""

    weights: Path  # the HF folder to load
    config_file: Path | None  # the run's config.yaml, or the export's bapo_config.yaml; None: a bare HF folder
    taken: dict[str, Any] = field(default_factory=dict)
    kept: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    withheld: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict:
        """What results.json's config says about the checkpoint."""
        kept = {key: {"command_line": cli, "run": ours} for key, (cli, ours) in self.kept.items()}
        cfg = None if self.config_file is None else str(self.config_file)
        return {
            "model_path": str(self.weights),
            "run_config": cfg,
            "from_run": self.taken,
            "overridden": kept,
            "not_from_run": self.withheld,
        }


def find_checkpoint(path: str) -> tuple[Path, Path | None]:
    """(the HF folder to load, the training config that came with it) for ``checkpoint=``.

    A training run folder holds its weights in ``export/`` and its config in ``config.yaml``; an
    export folder may carry the run's config as ``bapo_config.yaml``; a bare HF folder has neither."""
    p = Path(resolve_path(path))
    require(p.exists(), "checkpoint", f"{p.absolute()} does not exist")
    export = p / "export"
    if (export / "config.json").is_file():
        for cfg in (p / RUN_CONFIG, export / EXPORT_CONFIG):
            if cfg.is_file():
                return export, cfg
        return export, None
    if (p / "config.json").is_file():
        return p, (p / EXPORT_CONFIG) if (p / EXPORT_CONFIG).is_file() else None
    require(
        not (p / RUN_CONFIG).is_file(),
        "checkpoint",
        f"{p} is a training run without an export (export/config.json): a run writes it when it completes; "
        "evaluate a finished run, or an export folder",
    )
    raise ConfigError(
        f"checkpoint: {path} is neither a training run folder (with export/) nor an HF model folder (config.json)"
    )


def _cli_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys (and groups) an override on the command line sets: ``model``, ``max_new_tokens``, ..."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))}


def _on_command_line(key: str, cli: set[str]) -> bool:
    """Whether ``key`` was set on the command line: itself, or a group above it. ``rollout=<engine>`` picks
    the engine only (it is how a knob of the run's engine can be set at all); ``placement=`` picks both."""
    if key.startswith("rollout."):
        return "placement" in cli or key in cli or (key == "rollout.engine" and "rollout" in cli)
    parts = key.split(".")
    return any(".".join(parts[:i]) in cli for i in range(1, len(parts) + 1))


def evaluated_engine(run: dict) -> str:
    """The engine an evaluation of ``run`` (its config) uses: the run's, or the one its traits name for the eval
    ranks' own GPUs (``EngineTraits.eval_engine``: vLLM's servers ran on GPUs of their own, which an
    evaluation's ranks take)."""
    trained = run["rollout"]["engine"]
    return engine_traits(trained).eval_engine or trained


def _from_run(cfg: DictConfig, run: dict, engine: str) -> dict[str, Any]:
    """Eval key -> the run's value: the model group, the response budget, the prompt and the placement."""
    model = {k: v for k, v in run["model"].items() if k in cfg.model and k not in NOT_FROM_RUN + NEVER_FROM_RUN}
    out = {f"model.{k}": v for k, v in model.items()}
    out |= {
        "max_new_tokens": run["rollout"]["max_new_tokens"],
        "instruction": run["data"]["instruction"],
        "max_prompt_tokens": run["data"]["max_prompt_tokens"],
        "rollout.engine": evaluated_engine(run),
    }
    if engine in (run["rollout"]["engine"], evaluated_engine(run)):  # the knobs (a key the engine lacks is skipped;
        # its sleep settings mean nothing here, nor where the run's servers were: they hold the run's latest weights,
        # or another run's, not this checkpoint's, and their GPUs are the training node's layout, not the eval's)
        knobs = {k: v for k, v in run["rollout"].items() if k not in SAMPLING + RUN_PLACEMENT and "sleep" not in k}
        out |= {f"rollout.{k}": v for k, v in knobs.items()}
    return out


def checkpoint_weights(path: str | Path) -> dict:
    """The tensors of the checkpoint folder ``path`` (its safetensors files), for an engine that must be given them
    (a vLLM server started by someone else holds other weights)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    require(bool(files), "checkpoint", f"{path} holds no safetensors files to give the rollout engine")
    return {k: v for f in files for k, v in load_file(f).items()}


def _switch_engine(cfg: DictConfig, engine: str) -> None:
    """Replace ``cfg.rollout`` with the ``engine`` group's defaults, keeping eval.py's sampling keys."""
    sampling = {k: v for k, v in OmegaConf.to_container(cfg.rollout).items() if k in SAMPLING}
    node = OmegaConf.merge(compose_option("rollout", engine), sampling | {"engine": engine})
    with open_dict(cfg):
        cfg.rollout = node


def adopt_run(cfg: DictConfig, overrides: Sequence[str] = ()) -> RunSettings | None:
    """Evaluate a training run the way it was trained: ``cfg`` (composed, edited in place) takes the run's
    model group (weights from the checkpoint), ``rollout.max_new_tokens`` as ``max_new_tokens``,
    ``data.instruction`` and ``data.max_prompt_tokens``, and its rollout engine with that engine's knobs
    (GPU memory share, tensor parallelism, eager mode; not its sleep settings, which only training uses, nor
    where it ran: a server's URL and GPUs). An engine that ran on GPUs of its own (the vLLM servers of
    ``placement=gpu_node_split``) is replaced by the one its traits name for the eval ranks' own GPUs (in-process
    vLLM), with the knobs the two share.
    A key set on the command line (``overrides``, Hydra's task overrides) wins, and is logged: a group
    covers its keys (``model=tiny``: eval.py's whole model group), except that ``rollout=<engine>`` picks
    the engine only, so ``rollout=vllm rollout.enforce_eager=false`` keeps the run's other vLLM knobs.

    ``model.trust_remote_code`` is never taken from the run (:data:`NEVER_FROM_RUN`): a shared run folder or
    export must not decide to run code; only ``model.trust_remote_code=true`` on the command line does.

    None without ``checkpoint=``; for a bare HF folder, the settings are eval.py's own, as composed."""
    if cfg.checkpoint is None:
        return None
    require(
        isinstance(cfg.checkpoint, str) and cfg.checkpoint.strip() != "",
        "checkpoint",
        f"{cfg.checkpoint!r} is not a path: give a training run folder or an export (make eval RUN=<run>), or leave "
        "checkpoint out to evaluate model.name_or_path",
    )
    weights, config_file = find_checkpoint(cfg.checkpoint)
    settings = RunSettings(weights, config_file)
    if config_file is None:
        return settings
    run = _load_run_config(config_file)
    cli = _cli_keys(overrides)
    engine = cfg.rollout.engine if _on_command_line("rollout.engine", cli) else evaluated_engine(run)
    if engine != cfg.rollout.engine:
        _switch_engine(cfg, engine)
    if engine != run["rollout"]["engine"] and engine == evaluated_engine(run):
        log.info("checkpoint=%s: trained with rollout.engine=%s on GPUs of its own; evaluated with rollout.engine=%s "
                 "on the eval ranks' own GPUs", cfg.checkpoint, run["rollout"]["engine"], engine)  # fmt: skip
    for key, value in _from_run(cfg, run, engine).items():
        here = OmegaConf.select(cfg, key, default=_ABSENT)
        if here is _ABSENT:
            continue  # a key this eval config does not have (a newer or older run)
        if _on_command_line(key, cli):
            settings.kept[key] = (_plain(here), value)
            continue
        OmegaConf.update(cfg, key, value, merge=False)
        settings.taken[key] = value
    for key in NEVER_FROM_RUN:  # the command line's value, or eval.py's own; the run's is only reported
        ours, here = run["model"].get(key), cfg.model.get(key)
        if _on_command_line(f"model.{key}", cli):
            settings.kept[f"model.{key}"] = (here, ours)
        elif ours is not None and ours != here:
            settings.withheld[f"model.{key}"] = ours
            log.warning(
                "checkpoint=%s: its config says model.%s=%s; a run folder or export never decides that: model.%s=%s "
                "(pass model.%s=%s on the command line if you trust the code in %s)",
                cfg.checkpoint, key, json.dumps(ours), key, json.dumps(here), key, json.dumps(ours), weights,
            )  # fmt: skip
    OmegaConf.update(cfg, "model.name_or_path", str(weights), merge=False)
    lines = [f"  {key}={_show(v)}" for key, v in settings.taken.items()]
    lines += [
        f"  {key}={_show(given)} (command line) "
        + (f"overrides the run's {_show(ours)}" if given != ours else "as in the run")
        for key, (given, ours) in settings.kept.items()
    ]
    log.info("checkpoint=%s: evaluating as trained, with %s:\n%s", cfg.checkpoint, config_file, "\n".join(lines))
    return settings


def _load_run_config(path: Path) -> dict:
    """A run's config (bapo.infra.artifacts: read as data, never resolved; an interpolation in it is refused), with
    the groups evaluation reads; a damaged file is a ConfigError naming it."""
    try:
        run = load_config(path)
    except ArtifactError as e:
        raise ConfigError(f"checkpoint: {e}") from None
    need = {"model": ("dtype",), "rollout": ("engine", "max_new_tokens"), "data": ("instruction", "max_prompt_tokens")}
    for group, keys in need.items():
        node = run.get(group)
        missing = [f"{group}.{k}" for k in keys if not isinstance(node, dict) or k not in node]
        if missing:
            raise ConfigError(f"checkpoint: {path} is not a training run's config: it has no {missing[0]}")
    return run


_ABSENT = object()


def _plain(v: Any) -> Any:
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, dict | list) or v is None else str(v)
