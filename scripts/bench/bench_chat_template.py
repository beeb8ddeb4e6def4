"""Rendering prompts: the bounded renderer (bapo/infra/chat_template.py) against transformers' apply_chat_template.

Renders the same conversations (a math problem with the boxed-answer instruction) through each shipped tiny model's
template and through the Qwen2.5 and DeepSeek-R1 stand-ins' own templates (built into a temporary HF cache, as the
tests build them), and checks the texts are equal before timing. Prints the microseconds per conversation of each
and their ratio, medians over interleaved rounds.

    python scripts/bench/bench_chat_template.py [--rounds 5] [--n 2000]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this tree's bapo and scripts/

from scripts.bench.harness import ROOT, medians, parser, timed  # noqa: E402

QWEN, R1 = "Qwen/Qwen2.5-7B-Instruct", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"


def main() -> None:
    from transformers import AutoTokenizer

    from bapo.infra.chat_template import render_chat
    from scripts.build.standin import write_standin

    ap = parser(__doc__, rounds=5, threads=None)
    ap.add_argument("--n", type=int, default=2000, help="conversations per round and template")
    args = ap.parse_args()
    chats = [
        [{"role": "user", "content": f"What is {i} + {2 * i}?\nPut the final answer in \\boxed{{}}."}]
        for i in range(args.n)
    ]
    cache = Path(tempfile.mkdtemp(prefix="bench-chat-template-"))
    folders = {name: ROOT / "assets" / name for name in ("tiny-math", "tiny-ramble")}
    folders |= {repo.split("/")[1]: write_standin(cache, repo) for repo in (QWEN, R1)}
    for name, folder in folders.items():
        tok = AutoTokenizer.from_pretrained(folder)

        def hf(tok=tok) -> list[str]:
            return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]

        def bounded(tok=tok) -> list[str]:
            return [render_chat(tok, c) for c in chats]

        assert hf() == bounded(), f"{name}: the texts differ"
        runs: dict[str, list[float]] = {"transformers": [], "bounded": []}
        for _ in range(args.rounds):
            runs["transformers"].append(timed(hf)[0])
            runs["bounded"].append(timed(bounded)[0])
        m = medians(runs)
        us = {k: 1e6 * v / args.n for k, v in m.items()}
        print(
            f"{name:36s} transformers {us['transformers']:6.1f} us  bounded {us['bounded']:6.1f} us  "
            f"ratio {m['bounded'] / m['transformers']:.2f}x"
        )


if __name__ == "__main__":
    main()
