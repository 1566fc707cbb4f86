"""The seed grid syntax of `tq search-seed`: 0..100, 0..100:5, 1,7,42, or a mix."""

from __future__ import annotations

from tq_cli.errors import TqError
from tq_cli.quant.spec import MAX_SEED

MAX_SEEDS = 100_000
HOW = "use START..END (inclusive), START..END:STEP or a list like 1,7,42"


class SeedRangeError(TqError):
    """A seed range that cannot be parsed."""


def _int(text: str, whole: str, what: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise SeedRangeError(f"bad seed range '{whole}': {what} '{text.strip()}' is not a "
                             f"whole number; {HOW}") from None
    if value < 0:
        raise SeedRangeError(f"bad seed range '{whole}': {what} {value} is negative; {HOW}")
    if value > MAX_SEED:
        raise SeedRangeError(f"bad seed range '{whole}': {what} {value} is above the largest "
                             f"seed {MAX_SEED}; {HOW}")
    return value


def parse_seeds(text: str) -> list[int]:
    """The sorted, distinct seeds that `text` names."""
    if not text.strip():
        raise SeedRangeError(f"bad seed range '{text}': it is empty; {HOW}")
    seeds: set[int] = set()
    for part in text.split(","):
        if not part.strip():
            raise SeedRangeError(f"bad seed range '{text}': an empty item between commas; {HOW}")
        if ".." not in part:
            seeds.add(_int(part, text, "seed"))
            _check_count(seeds, text)
            continue
        span, _, step_text = part.partition(":")
        start_text, _, end_text = span.partition("..")
        start = _int(start_text, text, "start")
        end = _int(end_text, text, "end")
        step = _int(step_text, text, "step") if step_text else 1
        if step == 0:
            raise SeedRangeError(f"bad seed range '{text}': the step is 0; {HOW}")
        if end < start:
            raise SeedRangeError(f"bad seed range '{text}': end {end} is before start {start}; "
                                 f"{HOW}")
        if (end - start) // step + 1 + len(seeds) > MAX_SEEDS:
            raise SeedRangeError(f"bad seed range '{text}': more than {MAX_SEEDS} seeds; {HOW}")
        seeds.update(range(start, end + 1, step))
        _check_count(seeds, text)
    return sorted(seeds)


def _check_count(seeds: set[int], text: str) -> None:
    """The limit holds for all the items together, not for each range alone."""
    if len(seeds) > MAX_SEEDS:
        raise SeedRangeError(f"bad seed range '{text}': more than {MAX_SEEDS} seeds; {HOW}")
