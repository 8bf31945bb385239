"""Importing tokenmill pauses the cyclic collector and freezes the start-up heap (tokenmill/__init__.py):
no full collection walks torch's and the engine's objects during the import or after it, and the
collector is left as the caller had it; a failed import freezes nothing."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json, sys, weakref
if sys.argv[1] == "off":
    gc.disable()
if sys.argv[1] == "failing":
    sys.modules["tokenmill.llm"] = None   # importing it raises ImportError
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)
try:
    import tokenmill
    imported = True
except ImportError:
    imported = False
during = len(full)
class Node: pass
node = Node(); node.self = node; ref = weakref.ref(node); del node   # a cycle made after the import
gc.collect()
print(json.dumps({"imported": imported, "full_during_import": during, "enabled": gc.isenabled(),
                  "frozen": gc.get_freeze_count(), "cycle_collected": ref() is None}))
"""


def probe(state: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, state], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_runs_no_full_collection_and_restores_the_collector():
    on = probe("on")
    assert on["imported"] and on["full_during_import"] == 0   # (three without the pause, on torch 2.13)
    assert on["enabled"] and on["frozen"] > 100_000
    assert on["cycle_collected"]
    off = probe("off")
    assert off["imported"] and not off["enabled"] and off["frozen"] > 100_000


def test_a_failed_import_freezes_nothing_and_restores_the_collector():
    failing = probe("failing")
    assert not failing["imported"] and failing["enabled"] and failing["frozen"] == 0
