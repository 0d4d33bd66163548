"""docs/protocol.md links every Lua script rather than copying it: every file under protocol/lua/ is linked,
every link resolves, and the Lua spells no key name or priority (they come from protocol/keys.py as KEYS or
the layout ARGV). No Python module holds Lua any more."""

from __future__ import annotations

import json
import re
from pathlib import Path

from protocol import scripts
from protocol.keys import Keys
from protocol.priority import Priority

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "protocol.md"
LUA = ROOT / "protocol" / "lua"


def linked() -> set[Path]:
    return {(DOC.parent / link).resolve() for link in re.findall(r"\]\(([^)]+\.lua)\)", DOC.read_text())}


def test_every_lua_file_is_linked_and_every_link_resolves():
    files = {p.resolve() for p in LUA.glob("*.lua")}
    assert len(files) >= 17
    assert linked() == files, {"not linked": files - linked(), "no such file": linked() - files}


def test_the_lua_spells_no_key_name_or_priority():
    k = Keys("NS")
    spelled = [":q:", ":queues:", ":turn:", ":batch:", ":jobs", ":events", ":cancel", *(p.value for p in Priority)]
    # what we look for
    assert k.queue(Priority.bulk, "B") == "{NS}:q:bulk:B" and k.batch_jobs("B") == "{NS}:batch:B:jobs"
    for path in LUA.glob("*.lua"):
        code = "\n".join(line.split("--")[0] for line in path.read_text().splitlines())  # comments may name keys
        for literal in re.findall(r"'([^']*)'|\"([^\"]*)\"", code):
            text = "".join(literal)
            for word in spelled:
                assert word not in text, f"{path.name} spells {text!r}: pass it in (KEYS, or Keys.layout)"


def test_no_python_module_holds_lua():
    for pkg in ("protocol", "producer", "gateway", "worker"):
        for path in (ROOT / pkg).rglob("*.py"):
            assert "redis.call(" not in path.read_text(), f"{path}: Lua belongs in protocol/lua/*.lua"


def test_includes_are_expanded_once_each():
    text = scripts.lua("finish_job")
    assert "#include" not in text
    assert text.count("local function key(") == 1 and text.count("local function is_terminal(") == 1
    assert scripts.FINISH_JOB == text and "local function bump_batch(" in text


def test_the_doc_spells_out_the_layout_in_full():
    from tests.protocol.doc_client import layout

    assert json.loads(layout()) == json.loads(Keys("tokenbus").layout), "docs/protocol.md's layout JSON is stale"


def test_scripts_that_find_their_keys_name_the_routing_key_they_take():
    """READ, QUEUE_DEPTH and BUMP_BATCH find their keys from the layout, and take {ns}:config as KEYS 1 only to
    route the call on a Redis Cluster: their headers say so, as the doc does (not "KEYS: none")."""
    for name in ("read", "queue_depth", "bump_batch"):
        header = (LUA / f"{name}.lua").read_text().split("\n#", 1)[0]
        assert "-- KEYS: 1 {ns}:config, only to route" in header and "KEYS: none" not in header, name
    assert Keys("NS").routing_key == "{NS}:config"
