import copy

import torch

from bapo.algos import token_logp
from bapo.data import ArithSpec, arith_heldout, render_prompt
from bapo.learner import collate
from bapo.rollout import HFRollout
from bapo.types import ScoredSample


def _prompts(tok, n=6):
    return [render_prompt(p, tok) for p in arith_heldout(n, seed=1234, heldout_frac=0.1, spec=ArithSpec())]


def test_samples_are_tagged_and_shaped(tiny_model, tiny_tok):
    eng = HFRollout(tiny_model, tiny_tok, n=3, max_new_tokens=40, batch_size=8)
    eng.version = 7
    prompts = _prompts(tiny_tok)
    samples = eng.generate(prompts)
    assert len(samples) == 18
    # groups are contiguous and map back to their prompt, also across generate chunks (8 // 3 = 2 prompts a call)
    assert [s.group for s in samples] == [i // 3 for i in range(18)]
    assert all(s.prompt is prompts[s.group] for s in samples)
    for s in samples:
        assert s.version == 7
        assert len(s.logp) == len(s.response_ids) > 0
        assert all(lp <= 0 for lp in s.logp)
        assert s.truncated == (tiny_tok.eos_token_id not in s.response_ids)
        assert s.truncated or s.response_ids[-1] == tiny_tok.eos_token_id
        if s.truncated:
            assert len(s.response_ids) == 40


def test_behaviour_logp_matches_learner_forward(tiny_model, tiny_tok):
    """Left-padded KV-cache sampling and the right-padded learner pass agree per token."""
    for temperature in (1.0, 0.7):
        eng = HFRollout(copy.deepcopy(tiny_model), tiny_tok, n=4, temperature=temperature, max_new_tokens=48)
        samples = eng.generate(_prompts(tiny_tok, 8))
        batch = collate([ScoredSample(s, 0.0, 0.0, False) for s in samples], pad_id=tiny_tok.pad_token_id)
        with torch.no_grad():
            logits = tiny_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = token_logp(logits[:, :-1].float() / temperature, batch.input_ids[:, 1:])
        diff = ((logp - batch.old_logp) * batch.mask).abs().max().item()
        assert diff < 1e-4, diff
        assert batch.mask.sum().item() == sum(len(s.response_ids) for s in samples)


def test_greedy_is_deterministic(tiny_model, tiny_tok):
    eng = HFRollout(tiny_model, tiny_tok, n=1, max_new_tokens=40)
    a = [s.response_ids for s in eng.generate(_prompts(tiny_tok), temperature=0.0)]
    torch.manual_seed(123)
    b = [s.response_ids for s in eng.generate(_prompts(tiny_tok), temperature=0.0)]
    assert a == b


def test_update_weights_changes_policy_and_version(tiny_model, tiny_tok):
    eng = HFRollout(copy.deepcopy(tiny_model), tiny_tok, n=1, max_new_tokens=8)
    new = {k: v + 0.01 for k, v in tiny_model.state_dict().items()}
    eng.update_weights(new, version=3)
    assert eng.version == 3
    got = eng.model.state_dict()
    assert all(torch.equal(got[k], new[k]) for k in new)
    assert eng.generate(_prompts(tiny_tok, 1))[0].version == 3
