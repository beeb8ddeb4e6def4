"""Stand-ins the tests build from: a fake batch maker's checkpointed part, and perturbed weights."""

import copy

import torch


class CursorMaker:
    """The one-process part of a fake ``bapo.rollout.producer.BatchMaker``: gathering is the identity, and the state a
    checkpoint keeps is the prompt cursor. A fake adds ``make(t, version, weights)``, which moves the cursor."""

    cursor = 0

    def gather(self, item):
        return item

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]


def perturbed(model, scale=0.02, seed=1):
    """A deep copy of ``model`` with seeded Gaussian noise of std ``scale`` added to every parameter: other
    weights for an engine to load, reproducibly."""
    g = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return new
