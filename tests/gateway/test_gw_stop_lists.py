"""Stop lists are bounded (docs/protocol.md, MAX_STOP_STRINGS and MAX_STOP_CHARS): a tenant can no longer send
200,000 never-matching stop strings that every engine step then checks for everyone sharing it. Refused at the
gateway (chat and batch lines) before anything is queued."""

from __future__ import annotations

import openai
import pytest

from protocol.models import MAX_STOP_CHARS, MAX_STOP_STRINGS
from testbed.light_gateway import chat_line


def test_a_chat_with_too_many_stop_strings_is_refused(light_stack):
    client = light_stack.openai("alice")
    r = light_stack.r()
    before = len(r.keys("{tokenbus}:job:*"))
    for stop in ([f"never-{i}" for i in range(2000)], ["x" * (MAX_STOP_CHARS + 1)]):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], stop=stop)
        assert "stop" in err.value.body["message"]
    assert len(r.keys("{tokenbus}:job:*")) == before, "no job was queued"


def test_a_batch_with_a_line_of_too_many_stop_strings_fails_validation_naming_it(light_stack, tmp_path):
    many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    b = light_stack.batch("alice", [chat_line("a", "Hi", stop=["\n"]), chat_line("b", "Hi", stop=many)], tmp_path)
    done = light_stack.wait_status("alice", b.id, ("failed",))
    errors = [(e.line, e.message) for e in done.errors.data]
    assert len(errors) == 1 and errors[0][0] == 2 and f"at most {MAX_STOP_STRINGS} stop strings" in errors[0][1]
    assert not light_stack.r().keys(f"{{tokenbus}}:job:{b.id}-*"), "nothing was queued"
