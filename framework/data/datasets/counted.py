"""What a chat or pairs encoder cut and dropped, counted and said in one line each (rank 0)."""

from __future__ import annotations

from typing import Any

from framework.process.environment import env_rank


class Counted:
    """What an encoder cut to `max_length` and dropped, counted as rows are encoded (`seen`,
    `truncated`, and `drops`: the rows dropped for each reason) and said in one line each on rank
    0. `unit` names a row, `cut` what of a row is cut ("": the row itself); `why(reason)` says why
    a row is dropped ("": it has nothing to learn)."""

    unit, cut = "rows", ""
    max_length: int

    def __init__(self) -> None:
        self.seen = self.truncated = 0
        self.drops: dict[str, int] = {}

    @property
    def dropped(self) -> int:
        """Rows dropped, for any reason."""
        return sum(self.drops.values())

    def why(self, reason: str = "") -> str:
        raise NotImplementedError

    def drop(self, reason: str = "") -> None:
        """Count a row dropped for `reason`."""
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def counts(self) -> dict[str, Any]:
        """The counts (what a cache of the encoded rows keeps, `add` gives back)."""
        return {"seen": self.seen, "truncated": self.truncated, "drops": dict(self.drops)}

    def add(self, counts: dict[str, Any]) -> None:
        """Add counts made elsewhere (`counts` of the same rows encoded before)."""
        self.seen += int(counts["seen"])
        self.truncated += int(counts["truncated"])
        for reason, n in dict(counts["drops"]).items():
            self.drops[reason] = self.drops.get(reason, 0) + int(n)

    def say_dropped_so_far(self, reason: str = "") -> None:
        """After a drop in a stream (never counted to its end): the first and every doubling, one line."""
        n = self.drops.get(reason, 0)
        if n & (n - 1) == 0:
            say(f"data: {n} of {self.seen} {self.unit} read so far dropped: {self.why(reason)}")

    def report(self, what: str) -> None:
        """The counts of cut and dropped rows, one line each (`what`: "validation " or "")."""
        if self.truncated:
            say(
                f"data: {self.truncated} {self.cut}of {self.seen} {what}{self.unit} cut to "
                f"max_length={self.max_length} tokens (data.dataset.max_length to change)"
            )
        for reason, n in self.drops.items():
            say(f"data: {n} of {self.seen} {what}{self.unit} dropped: {self.why(reason)}")


def say(line: str) -> None:
    """A line on rank 0."""
    if env_rank() == 0:
        print(line, flush=True)
