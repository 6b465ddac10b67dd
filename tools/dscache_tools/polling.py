"""Waiting for a condition: one rule for all tooling (dev cluster, demos, benches) and the tests.

Contract:
    * :func:`poll` calls a probe until it returns something truthy or the time
      is up, and returns the last value (falsy on time-out); an exception from
      the probe is not retried, it propagates at once (a probe raises to say
      "this will never become true", e.g. a process died).
    * :func:`wait_until` is :func:`poll` that raises :class:`TimeoutError`
      naming what it waited for and the last value seen.
    * Both are tenacity's ``Retrying`` with a fixed interval; nothing here sleeps
      by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_not_result, stop_after_delay, wait_fixed

T = TypeVar("T")


def _last_result(state: RetryCallState) -> object:
    return state.outcome.result() if state.outcome is not None else None


def poll(probe: Callable[[], T], timeout: float, interval: float = 0.25) -> T:
    """Calls ``probe`` every ``interval`` s until it returns something truthy; returns the last.

    Args:
        probe: Returns a falsy value for "not yet".
        timeout: Seconds after which the last (falsy) value is returned;
            ``0`` or less probes once.
        interval: Seconds between two calls.
    """
    retrying = Retrying(
        stop=stop_after_delay(max(0.0, timeout)),
        wait=wait_fixed(interval),
        retry=retry_if_not_result(bool),
        retry_error_callback=_last_result,
    )
    result: T = retrying(probe)
    return result


def wait_until(
    what: str, probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.25
) -> T:
    """Polls ``probe`` until it returns something truthy, and returns that.

    Raises:
        TimeoutError: ``timeout`` seconds passed; the message names ``what``
            and the last value seen.
    """
    last = poll(probe, timeout, interval)
    if not last:
        raise TimeoutError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")
    return last
