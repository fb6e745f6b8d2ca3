"""Hostile upload checks for ``UploadValidator`` tests. They run in the worker process, which
unpickles them by reference, so this module imports only the standard library (fast)."""

from __future__ import annotations

import re

ISSUE_REGEX = r"model\.layers\.(\d+)+\.self_attn\.q_projX"
ISSUE_NAME = "model.layers." + "0" * 26 + ".self_attn.q_proj"


def gil_holding_check(job):
    """Holds the GIL until killed: Python's ``re`` on the issue's pattern and name (11.6 s per
    match on the reporter's machine, twice that per extra zero), over and over."""
    while True:
        re.fullmatch(ISSUE_REGEX, ISSUE_NAME)


def memory_hungry_check(job):
    """Allocates 4 GB (what a decompression bomb would do)."""
    buffers = [bytearray(1 << 30) for _ in range(4)]
    raise AssertionError(f"the memory cap should have stopped this ({len(buffers)} GiB allocated)")


def crashing_check(job):
    """Fails with an unexpected error whose text names a server path."""
    raise RuntimeError(f"unexpected failure reading {job.dest}")
