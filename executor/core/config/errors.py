"""ConfigError: the one error type for a configuration that cannot run, raised before any model loads."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration mistake. One problem is one line naming the key, file or line at fault; a
    file with several problems gives one error listing all of them, one line each."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]

    @classmethod
    def from_problems(cls, problems: list[str], source: str) -> ConfigError:
        assert problems
        if len(problems) == 1:
            return cls(problems[0])
        lines = "\n".join(f"  - {problem}" for problem in problems)
        return cls(f"{len(problems)} problems in {source}:\n{lines}", problems)
