"""Kubernetes quantities ('4Gi', '500m', '1e9'): exact values, and whole bytes for byte budgets."""

import math
import re
from decimal import Decimal

_SUFFIXES = {
    "": 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(
    r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?"
)


def quantity_value(quantity: str, field: str | None = None) -> Decimal:
    """The exact value of `quantity`; ValueError (naming `field`, if given) when it is not a
    quantity this parser reads."""
    match = _QUANTITY.fullmatch(str(quantity))
    if match is None:
        where = f"{field}: " if field else ""
        raise ValueError(f"{where}{quantity!r} is not a Kubernetes quantity like '4Gi'")
    number, suffix = match.groups()
    return Decimal(number) * _SUFFIXES[suffix or ""]


def quantity_bytes(quantity: str, field: str | None = None) -> int:
    """Bytes in `quantity`, rounded up; ValueError (naming `field`, if given) when it is not a
    quantity this parser reads (the API models check byte budgets with it)."""
    return math.ceil(quantity_value(quantity, field))
