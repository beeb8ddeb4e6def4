"""HF transformers generation engine (the CPU path).

Samples ``n`` responses per prompt with ``model.generate`` and the KV cache, and
returns, for each response, the token ids, the behaviour log-probabilities of
the sampled tokens and the policy version of the weights that produced them.

The behaviour log-probability is taken under the sampling distribution
softmax(logits / temperature), which is what the learner recomputes. top-k is
off; with ``top_p < 1`` the sampled tokens come from the nucleus, but their
recorded log-probabilities are still those of the full tempered distribution
(as verl and vLLM's default logprobs do).

The engine owns its own copy of the weights: the learner pushes new weights in
with :meth:`update_weights`, so between two syncs the engine keeps generating
with the older policy, exactly as an off-policy engine on another device would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from bapo.types import Prompt, Sample


class HFRollout:
    """Batched sampling with HF ``generate``."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        n: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        batch_size: int = 128,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.n = n
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.version = 0
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Load the learner's weights; returns the seconds it took."""
        t0 = time.perf_counter()
        self.model.load_state_dict(state_dict, strict=True)
        self.version = version
        return time.perf_counter() - t0

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample ``n`` responses per prompt; ``temperature=0`` means greedy; ``seed`` makes it reproducible."""
        if seed is not None:
            torch.manual_seed(seed)
        n = self.n if n is None else n
        temperature = self.temperature if temperature is None else temperature
        per_call = max(1, self.batch_size // n)
        out: list[Sample] = []
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start : start + per_call]
            out.extend(self._generate_chunk(chunk, start, n, temperature))
        return out

    @torch.no_grad()
    def _generate_chunk(self, prompts: Sequence[Prompt], group0: int, n: int, temperature: float) -> list[Sample]:
        width = max(len(p.ids) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p.ids) :] = torch.tensor(p.ids)
            attn[i, width - len(p.ids) :] = 1
        greedy = temperature <= 0
        gen = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            do_sample=not greedy,
            temperature=None if greedy else temperature,
            top_p=None if greedy else self.top_p,
            top_k=None,
            max_new_tokens=self.max_new_tokens,
            num_return_sequences=n,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = gen.sequences[:, width:].cpu()  # [B*n, T]
        scale = 1.0 if greedy else temperature
        # one step at a time: never materialise [B*n, T, V] (vocabularies of real models are large)
        logp = torch.stack(
            [
                torch.log_softmax(step.float() / scale, dim=-1).gather(-1, new[:, t : t + 1].to(step.device))[:, 0]
                for t, step in enumerate(gen.logits)
            ],
            dim=1,
        ).cpu()  # [B*n, T]
        samples = []
        for row in range(new.shape[0]):
            toks = new[row].tolist()
            end = toks.index(self.eos_id) + 1 if self.eos_id in toks else len(toks)
            truncated = self.eos_id not in toks
            resp = toks[:end]
            prompt = prompts[row // n]
            samples.append(
                Sample(
                    prompt=prompt,
                    group=group0 + row // n,
                    response_ids=tuple(resp),
                    logp=tuple(logp[row, :end].tolist()),
                    text=self.tokenizer.decode(resp, skip_special_tokens=True),
                    version=self.version,
                    truncated=truncated,
                )
            )
        return samples
