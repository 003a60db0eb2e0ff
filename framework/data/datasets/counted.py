"""What a chat or pairs encoder cut and dropped, counted and said in one line each (rank 0)."""

from __future__ import annotations

from framework.process.environment import env_rank


class Counted:
    """What an encoder cut to `max_length` and dropped, counted as rows are encoded (`seen`,
    `truncated`, `dropped`) and said in one line each on rank 0. `unit` names a row, `cut` what of
    a row is cut ("": the row itself); `why` says why a row is dropped."""

    unit, cut = "rows", ""
    max_length: int

    def __init__(self) -> None:
        self.seen = self.truncated = self.dropped = 0

    def why(self) -> str:
        raise NotImplementedError

    def say_dropped_so_far(self) -> None:
        """After a drop in a stream (never counted to its end): the first and every doubling, one line."""
        if self.dropped & (self.dropped - 1) == 0:
            _say(f"data: {self.dropped} of {self.seen} {self.unit} read so far dropped: {self.why()}")

    def report(self, what: str) -> None:
        """The counts of cut and dropped rows, one line each (`what`: "validation " or "")."""
        if self.truncated:
            _say(
                f"data: {self.truncated} {self.cut}of {self.seen} {what}{self.unit} cut to "
                f"max_length={self.max_length} tokens (data.dataset.max_length to change)"
            )
        if self.dropped:
            _say(f"data: {self.dropped} of {self.seen} {what}{self.unit} dropped: {self.why()}")


def _say(line: str) -> None:
    if env_rank() == 0:
        print(line, flush=True)
