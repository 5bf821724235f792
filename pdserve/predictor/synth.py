"""A synthetic trace whose output lengths depend learnably on the prompt.

A random-weight model's own output lengths are noise, so a predictor trained on them learns
nothing; this trace stands in for "prompts run through the pinned target model": each prompt
starts with a task word, the task sets the output-length range, and a fraction `noise` of the
requests run one range longer than their task says (they outgrow a correct prediction's bucket:
the reservation-growth path). Lines are the bench's trace format (`{"prompt", "output_len"}`)
plus the task, so `pdserve bench --trace` replays them and `pdserve predictor train` learns them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# task word -> output length range [lo, hi], inside [32, 128) and one 32-token bucket each
TASKS = (("tag", 32, 60), ("summarize", 64, 92), ("explain", 96, 124))
FILLER = ("alpha", "river", "stone", "cloud", "maple", "orbit", "pixel", "quartz", "ember", "delta", "lumen",
          "cedar", "sonic", "tidal", "vivid", "woven", "zephyr", "bronze", "coral", "frost", "glade", "harbor")


def synth_entries(n: int, seed: int = 0, noise: float = 0.1, min_words: int = 4, max_words: int = 16) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = rng.randrange(len(TASKS))
        if rng.random() < noise and task + 1 < len(TASKS):
            task_len = task + 1  # runs longer than its task word says
        else:
            task_len = task
        _, lo, hi = TASKS[task_len]
        words = [rng.choice(FILLER) for _ in range(rng.randint(min_words, max_words))]
        prompt = f"{TASKS[task][0]}: " + " ".join(words)
        out.append({"prompt": prompt, "output_len": rng.randint(lo, hi), "task": TASKS[task][0]})
    return out


def write_trace(path: str | Path, entries: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(e) + "\n" for e in entries))
