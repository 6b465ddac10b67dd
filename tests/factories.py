"""Factory fixtures: a test makes as many running things as it needs, all stopped after it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, Protocol, TypeVar


class Stoppable(Protocol):
    def stop(self) -> None: ...


P = ParamSpec("P")
T = TypeVar("T", bound=Stoppable)


@contextmanager
def stopped_after(build: Callable[P, T]) -> Iterator[Callable[P, T]]:
    """Yields ``build`` wrapped so that everything it made is stopped on exit, newest first."""
    made: list[T] = []

    def make(*args: P.args, **kwargs: P.kwargs) -> T:
        thing = build(*args, **kwargs)
        made.append(thing)
        return thing

    try:
        yield make
    finally:
        for thing in reversed(made):
            thing.stop()
