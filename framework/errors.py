"""The errors a run reports in one line (the CLI prints them without a traceback)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot run, with a message that says what to write instead.

    Raised about one option of an object (`ConfigError.about`), it names the object and the
    parameter as the Python API spells them (`DPO(beta=0): must be > 0`); a run built from a
    config tree (`framework.build`) words the same error with the config key instead
    (`objective.beta=0: must be > 0`)."""

    def __init__(self, message: str, *, option: str | None = None, value: Any = None, reason: str = ""):
        super().__init__(message)
        self.option, self.value, self.reason = option, value, reason or message

    @classmethod
    def about(cls, owner: str, option: str, value: Any, reason: str) -> ConfigError:
        """An error about `owner`'s parameter `option` given `value`: `reason` says what is wrong."""
        return cls(f"{owner}({option}={value!r}): {reason}", option=option, value=value, reason=reason)

    def at(self, key: str) -> str:
        """The message for the config node at `key` (`objective`): the option's config key."""
        if self.option is None:
            return str(self)
        return f"{key}.{self.option}={self.value}: {self.reason}"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, damaged or does not fit this run."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite: training stops (the last good checkpoint stays).
    `step`: the optimizer step whose loss it was first, when known."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step
