"""Reward shaping on top of the verifier's score.

``overlong_penalty`` is DAPO's soft overlong punishment (Yu et al., 2025, eq. 13):
a response that runs into the last ``buffer`` tokens before ``max_len`` loses
reward linearly, down to -1 at ``max_len``; longer ones get -1. It depends only
on the length, so it shapes the training reward and never the ``correct`` flag
used for accuracy. ``buffer=0`` turns it off.
"""


def overlong_penalty(length: int, *, max_len: int, buffer: int) -> float:
    """0 up to ``max_len - buffer`` tokens, then linear to -1 at ``max_len``; -1 beyond it."""
    if buffer <= 0 or length <= max_len - buffer:
        return 0.0
    if length > max_len:
        return -1.0
    return (max_len - buffer - length) / buffer
