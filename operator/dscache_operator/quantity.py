"""Kubernetes resource quantities (``10Gi``, ``500M``), read by the Kubernetes client's parser.

The one place the pure operator modules reach into the ``kubernetes`` package:
:func:`kubernetes.utils.parse_quantity` is a pure function, so the
"operator logic is pure" import contract lets this module (and only it) import
it, through an ``ignore_imports`` entry.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import cast

from kubernetes.utils.quantity import parse_quantity


def quantity_bytes(value: str) -> int:
    """``10Gi`` -> 10737418240; a fraction of a byte is dropped.

    Raises:
        ValueError: ``value`` is not a Kubernetes quantity.
    """
    return int(_parse(value))


def whole_cores(value: str) -> int:
    """A CPU quantity rounded up to whole cores: ``100m`` -> 1, ``1500m`` -> 2, ``4`` -> 4.

    Raises:
        ValueError: ``value`` is not a Kubernetes quantity.
    """
    return max(1, math.ceil(_parse(value)))


def _parse(value: str) -> Decimal:
    # The client ships no type hints; its parser returns a Decimal.
    return cast("Decimal", parse_quantity(value))  # type: ignore[no-untyped-call]
