"""Stop strings are found by one automaton over the text's tail (worker/engine/stop_checker.py): the same hits as
looking for each string on its own, on random texts and lists where stops overlap, nest and span tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

from worker.engine.sampling_params import SamplingParams
from worker.engine.stop_checker import StopChecker


def naive_hits(text: str, stops: tuple[str, ...], window_start: int) -> int | None:
    found = [i for s in stops if (i := text.find(s, window_start)) != -1]
    return min(found) if found else None


def test_the_automaton_finds_what_each_string_alone_finds():
    rng = random.Random(7)
    for case in range(3000):
        alphabet = "ab c\né"[: rng.randint(2, 6)]
        stops = tuple({"".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 16))})
        params = SamplingParams(stop=list(stops))
        seq = SimpleNamespace(params=params)
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
        new_from = rng.randint(0, len(text))
        hits = StopChecker._stop_hits(text, seq, new_from)
        window_start = max(0, new_from - params.stop_hold)
        assert (min(hits) if hits else None) == naive_hits(text, stops, window_start), (case, stops, text, new_from)


def test_only_the_tail_is_scanned():
    """A stop string wholly before the window (it ended before this token's text) is not found again."""
    params = SamplingParams(stop=["END", "zz"])
    seq = SimpleNamespace(params=params)
    text = "END" + "x" * 10_000 + "z"
    assert StopChecker._stop_hits(text, seq, len(text) - 1) == []
    assert StopChecker._stop_hits(text + "z", seq, len(text)) == [len(text) - 1]
