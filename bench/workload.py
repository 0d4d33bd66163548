"""The benchmark workloads shared by `tokenbus bench`, benchmarks/engine/ and benchmarks/e2e/: 64 chat prompts
with long-tailed output lengths (8–256 tokens), greedy, EOS ignored, so every system generates exactly the same
count; one long instruction shared by every request; and chat_ids, the prompts as every benchmark tokenizes
them."""

from __future__ import annotations

import random

TOPICS = ["the ocean", "volcanoes", "a small bakery", "the history of tea", "black holes", "chess openings",
          "bees", "the Roman roads", "rainforests", "solar panels", "jazz", "glaciers", "the printing press",
          "octopuses", "desert plants", "lighthouses"]
TASKS = ["Write a short story about {t}.", "Explain {t} to a ten-year-old.", "List five facts about {t}.",
         "Write a poem about {t}, with a title and at least three verses, and then explain the imagery you chose "
         "line by line so that a student could follow it."]


def workload(num_prompts: int = 64, seed: int = 0, min_tokens: int = 8, max_tokens: int = 256):
    """[(messages, max_tokens)]: output lengths follow a Pareto tail clipped to [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    items = []
    for i in range(num_prompts):
        task = TASKS[i % len(TASKS)].format(t=TOPICS[(i * 7) % len(TOPICS)])
        length = int(min(max_tokens, max(min_tokens, min_tokens * rng.paretovariate(0.9))))
        items.append(([{"role": "user", "content": task}], length))
    return items


def chat_ids(tokenizer, items) -> list[list[int]]:
    """The token ids of each item's messages in the model's chat template, the assistant's turn opened."""
    return [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)
                 ["input_ids"]) for m, _ in items]


SHOP = ["hammer", "drill", "ladder", "saw", "wrench", "tape", "glue", "sander", "clamp", "chisel", "level",
        "pliers", "rake", "shovel", "bucket", "hose"]


def shared_prefix_workload(num_requests: int = 256, seed: int = 0, min_tokens: int = 8, max_tokens: int = 256,
                           rules: int = 28):
    """[(messages, max_tokens)]: one long system instruction (~1,000 tokens with 28 rules) shared by every
    request, then a distinct short question each; output lengths long-tailed as workload()'s."""
    rng = random.Random(seed)
    instruction = "You answer questions for a hardware shop. Follow every rule below exactly.\n" + "\n".join(
        f"Rule {i + 1}: the {SHOP[i % len(SHOP)]} in aisle {i % 9 + 1} costs {5 + 3 * i} euros, ships in "
        f"{i % 6 + 1} days, and must be recommended to customers working on {TOPICS[i % len(TOPICS)]}."
        for i in range(rules))
    items = []
    for i in range(num_requests):
        question = (f"Question {i}: which {SHOP[(i * 5) % len(SHOP)]} fits a project about "
                    f"{TOPICS[(i * 3) % len(TOPICS)]}, and what does it cost?")
        length = int(min(max_tokens, max(min_tokens, min_tokens * rng.paretovariate(0.9))))
        items.append(([{"role": "system", "content": instruction}, {"role": "user", "content": question}], length))
    return items
