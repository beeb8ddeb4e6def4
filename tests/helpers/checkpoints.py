"""Damage for checkpoint tests: a pickled payload that runs a command, a flipped byte, a full disk."""

import errno
import os
from pathlib import Path


class Payload:
    """What an attacker pickles: unpickling it calls ``os.system(cmd)``."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def flip_byte(f: Path, at: int | None = None) -> None:
    data = bytearray(f.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    f.write_bytes(bytes(data))


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
