"""Where the repository is, how a relative path that a config names is found, and the config file an export carries."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EVAL_DIR = ROOT / "conf" / "eval"  # the `eval` group: training's held-out config and eval.py's sets
HELDOUT = "heldout"  # conf/eval/heldout.yaml, training's held-out evaluation (train.py's `eval: heldout`)


def eval_sets() -> list[str]:
    """The names of eval.py's sets: every option of the `eval` group but training's held-out config (each set
    sits under ``eval.<name>``; training runs them by name with ``eval.sets``)."""
    return sorted(p.stem for p in EVAL_DIR.glob("*.yaml") if p.stem != HELDOUT)


def resolve_path(p: str) -> str:
    """A relative path that exists from the working directory, else from the repo root, else unchanged."""
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return str(path)
    if (ROOT / path).exists():
        return str(ROOT / path)
    return p


def compose_option(group: str, option: str):
    """``conf/<group>/<option>.yaml`` as Hydra composes it (its defaults list applied, interpolations kept), for
    code that needs one option's keys outside the run's own composition. Inside a Hydra app (or an initialized
    compose context) it uses that context; otherwise it opens one on the repository's ``conf/``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name=f"{group}/{option}")[group]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name=f"{group}/{option}")[group]


EXPORT_CONFIG = "bapo_config.yaml"  # the resolved config of the run that wrote an export, beside its weights


def exported_max_new_tokens(model_dir: str | Path | None) -> int | None:
    """``rollout.max_new_tokens`` of the run that wrote the export ``model_dir`` (its ``bapo_config.yaml``), or
    None when the folder has none or it cannot be read."""
    f = Path(model_dir) / EXPORT_CONFIG if model_dir else None
    if f is None or not f.is_file():
        return None
    from bapo.infra.artifacts import load_yaml

    try:
        saved = load_yaml(f)  # an export is data: bounded, never resolved
        value = saved["rollout"]["max_new_tokens"]
        if isinstance(value, str):  # an interpolation left in the file: the model's value
            value = saved["model"]["max_new_tokens"]
    except Exception:  # unreadable, nested too deeply, not a run's config: no advice rather than a second error
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
