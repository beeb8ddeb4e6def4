"""The reward registry: ``reward.kind`` names what grades a response against its gold answer, and the class that does.

A reward is a class, named here by a dotted path (``"module:Class"``) and imported only when a config chooses it, as
the engines and the placements are (or named by its own import path, ``reward.kind=package.module:Class``, from
outside this repository). It declares

- ``config``: its schema, a dataclass that subclasses :class:`bapo.reward.config.RewardConfig` with the keys only it
  reads (``reward.<key>``; ``+reward.<key>=...`` on the command line for a plug-in's own);
- ``from_config(cfg)``: the verifier the typed ``reward`` group describes;

and is a :class:`Verifier`: ``grade`` a batch of responses against their answers (a :class:`bapo.reward.pool.Grade`
each, and :class:`bapo.reward.pool.RewardStats` for the logger), ``close`` what it started; a context manager.
:func:`build_verifier` is the one builder, used by training (``bapo.build``) and ``eval.py`` alike. A new reward is
its module, one line in :data:`REWARDS` and one YAML in ``conf/reward/`` (docs/extending.md, "A new reward"); the
contract test (``tests/contracts/test_reward_contract.py``) runs every registered one by itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from bapo.infra.checks import Schemas, plugin

REWARDS: dict[str, str] = {
    "math": "bapo.reward.pool:MathVerifier",
}


@runtime_checkable
class Verifier(Protocol):
    """What grades a run's responses (training's rewards and eval.py's accuracy alike)."""

    def grade(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[list, Any]:
        """One ``Grade`` per response (reward, correct, extracted answer) and the batch's ``RewardStats``."""
        ...

    def close(self) -> None:
        """End what the verifier started (worker processes); a later ``grade`` may start them again."""
        ...

    def __enter__(self) -> Verifier: ...

    def __exit__(self, *exc: object) -> None: ...


def _lacks_reward(cls: Any) -> str | None:
    from bapo.reward.config import RewardConfig

    if not isinstance(cls, type):
        return f"a {type(cls).__name__} is not a class (docs/extending.md, a new reward)"
    lacks = [a for a in ("config", "from_config", "grade", "close", "__enter__", "__exit__") if not hasattr(cls, a)]
    if lacks:
        return f"it needs {lacks} (docs/extending.md, a new reward)"
    if not (isinstance(cls.config, type) and issubclass(cls.config, RewardConfig)):
        return "its config must subclass bapo.reward.config.RewardConfig"
    return None


def reward_class(name: str) -> type:
    """The class registered as ``name``, or that the import path ``package.module:Class`` names (a reward outside
    this repository), imported now; a ConfigError names the choices or what the class lacks."""
    return plugin(name, REWARDS, "reward.kind", kind="a reward class", lacks=_lacks_reward)


REWARD_CONFIGS: Mapping[str, type] = Schemas(REWARDS, reward_class)  # reward.kind's schemas


def build_verifier(cfg: Any) -> Verifier:
    """The verifier of the typed ``reward`` group (its ``kind``'s class, ``from_config``)."""
    return reward_class(cfg.kind).from_config(cfg)
