"""What runs inside the workers of a ``rollout=vllm_server`` server: the worker extension :class:`WeightLoader`, which
the server loads by its dotted path (``--worker-extension-cls bapo.engines.vllm_extension.WeightLoader``) and the
engine calls on every worker through ``POST /collective_rpc``. It reports what model the worker holds and how the
server samples (:meth:`WeightLoader.bapo_describe`), reloads a staged weight folder in place
(:meth:`WeightLoader.bapo_reload`: each tensor fingerprinted as it is handed to vLLM's reload, a parameter left
without weights refused, the CPU build's tied output layer re-packed) and answers with what it read. vLLM and the
staging reader are imported inside the methods, so the engine imports this module without vLLM.
"""

from __future__ import annotations

# what must agree between the learner's checkpoint and the server's model (config.json keys)
IDENTITY = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


class WeightLoader:
    """vLLM worker extension (``--worker-extension-cls bapo.engines.vllm_extension.WeightLoader``): methods the
    engine calls on every worker of the server through ``POST /collective_rpc``."""

    def bapo_describe(self) -> dict:
        cfg = self.model_runner.model_config
        hf = cfg.hf_config.to_dict()
        cache, sched = self.vllm_config.cache_config, self.vllm_config.scheduler_config
        blocks = getattr(cache, "num_gpu_blocks", None)
        return {
            "max_model_len": int(cfg.max_model_len),
            "logprobs_mode": str(cfg.logprobs_mode),
            "generation_config": str(cfg.generation_config),
            "kv_tokens": int(blocks * cache.block_size) if blocks else None,
            "max_num_seqs": int(sched.max_num_seqs),
            "positional_draws": bool(getattr(self, "use_v2_model_runner", False)) and not _on_cpu(),
        } | {k: hf.get(k) for k in IDENTITY}

    def bapo_reload(self, path: str) -> dict:
        """Reload the staged folder ``path`` in place; returns what was read (checked against its manifest)."""
        from vllm.platforms import current_platform

        from bapo.engines.staging import Reader, reload_checked
        from bapo.engines.vllm import _repack_lm_head

        device = "cpu" if current_platform.is_cpu() else self.device
        reader = Reader(path, device)
        reload_checked(self, iter(reader))
        if current_platform.is_cpu():  # a tied output layer keeps its old packed copy on CPU
            _repack_lm_head(self)
        return reader.check()

    def bapo_fingerprint(self, path: str) -> dict:
        """What :meth:`bapo_reload` would read from ``path``, without loading it (the GPU check's probe)."""
        from bapo.engines.staging import Reader

        reader = Reader(path)
        for _ in reader:
            pass
        return reader.check()


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
