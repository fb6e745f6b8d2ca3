"""The demo banner's examples on a later start, when the demo key is no longer printed.

The ``openai`` example then reads the key from ``DEMO_KEY``; without it, a new user who pasted the
example got a raw ``KeyError: 'DEMO_KEY'`` traceback (found by a fresh-clone walkthrough). It now
exits with one line saying what to set and how to get a new key; the banner names both too.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess

from loraplex.platform.demo import DemoSetup, banner, openai_example


def _run(example: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", example], capture_output=True, text=True, timeout=120, env=env)


def test_openai_example_without_demo_key_says_what_to_set():
    example = openai_example("http://127.0.0.1:9", None, ["json-answer"])
    env = {k: v for k, v in os.environ.items() if k != "DEMO_KEY"}
    proc = _run(example, env)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("set DEMO_KEY to the demo key printed at first start "
                                   "(`loraplex key create demo` makes a new one)")
    assert "Traceback" not in proc.stderr


def test_openai_example_with_demo_key_uses_it():
    # Port 9 (discard) refuses the connection: the client must get as far as connecting with the key.
    example = openai_example("http://127.0.0.1:9", None, ["json-answer"])
    proc = _run(example, {**os.environ, "DEMO_KEY": "lpx-test"})
    assert proc.returncode == 1 and "APIConnectionError" in proc.stderr, proc.stderr[-500:]


def test_later_start_banner_names_the_variable_and_the_new_key_command():
    later = DemoSetup(tenant="demo", tenant_created=False, tenant_key=None, admin_key=None,
                      admin_key_from_settings=False, adapters=())
    text = banner("http://127.0.0.1:8000", "smollm2-135m-instruct", later)
    assert "`export DEMO_KEY=<that key>`" in text and "`loraplex key create demo`" in text
    assert "Bearer $DEMO_KEY" in text  # the curl examples read it
    first = dataclasses.replace(later, tenant_created=True, tenant_key="lpx-abc")
    text = banner("http://127.0.0.1:8000", "smollm2-135m-instruct", first)
    assert "`export DEMO_KEY=lpx-abc`" in text and "Bearer lpx-abc" in text and "Bearer $DEMO_KEY" not in text
