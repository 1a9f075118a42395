"""Quality-proxy calibration pairs, shared by the pods of one deployment.

A pod's inline quality proxy (runtime/quality/inline_proxy.py) estimates answer quality
from each blend's own statistic once it holds enough (statistic, shadow score) pairs; a
pod that starts has none, and a saturated pod's shadows score a few a minute, so on its
own it would estimate nothing for minutes, exactly when the tuner needs a signal. The
pods publish their pairs here (`pairs_add`) and read the others' (`pairs_get`), as they
share the segment index, so a pod that starts, restarts or scales out is calibrated as
soon as its deployment is.

- Pairs are grouped by `scope`, what makes two pods' statistics comparable (the runtime
  names the statistic's version, the model, its dtypes, tensor-parallel size and the
  blend settings that change the statistic's scale in it:
  `holeblend_runtime.quality.shared_calibration.calibration_scope`).
- Each scope keeps its newest `max_pairs` pairs, and the store at most `max_scopes`
  scopes (the one written least recently goes first): bounded whatever clients send.
- Every pair gets a sequence number. `pairs_get` answers the pairs after `after` that
  *other* pods published (never the asking pod's own, which it already holds), oldest
  first, at most `max_reply` per call; `last` is where the next call continues and
  `epoch` names this server's life, so a client whose `after` came from a server that
  restarted (numbers start again) reads from the start.
- A pod numbers its own pairs (`ids` of `pairs_add`); each pair is answered with who
  published it and that number, so a pod that reads a restarted server's pairs from the
  start knows the ones it had before (the others publish theirs again), while equal
  pairs of different requests stay apart.

Not thread-safe by design: the lookup server's one event loop owns it.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

# One pair as stored: (sequence number, pod, the pod's own number of it or None, ratio,
# statistic, f1, top1).
Record = tuple[int, str, int | None, float, float, float, float]


@dataclass(frozen=True)
class CalibrationLimits:
    # Scopes kept at most (a deployment serves one model: normally one or two).
    max_scopes: int = 16
    # Newest pairs kept per scope (the inline proxy keeps 256 per ratio over 16 ratios).
    max_pairs: int = 4096
    # Pairs in one `pairs_get` reply at most (the client asks again for the rest).
    max_reply: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_scopes", "max_pairs", "max_reply"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


class CalibrationPairs:
    """The shared pairs, per scope."""

    def __init__(self, limits: CalibrationLimits | None = None) -> None:
        self.limits = limits or CalibrationLimits()
        self.epoch = secrets.token_hex(8)
        self._scopes: OrderedDict[str, deque[Record]] = OrderedDict()
        self._numbers = itertools.count(1)
        self.num_added = 0

    def add(
        self,
        scope: str,
        pod: str,
        pairs: list[tuple[float, float, float, float]],
        ids: Sequence[int] | None = None,
    ) -> int:
        """Keep `pod`'s (ratio, statistic, f1, top1) pairs under `scope`, with the pod's
        own number of each (`ids`; None: not numbered); how many."""
        if not pairs:
            return 0
        if ids is not None and len(ids) != len(pairs):
            raise ValueError(f"ids: {len(ids)} for {len(pairs)} pairs")
        kept = self._scopes.get(scope)
        if kept is None:
            kept = self._scopes[scope] = deque(maxlen=self.limits.max_pairs)
            while len(self._scopes) > self.limits.max_scopes:
                self._scopes.popitem(last=False)
        self._scopes.move_to_end(scope)
        numbers = ids if ids is not None else [None] * len(pairs)
        for (ratio, statistic, f1, top1), own in zip(pairs, numbers, strict=True):
            kept.append((next(self._numbers), pod, own, ratio, statistic, f1, top1))
        self.num_added += len(pairs)
        return len(pairs)

    def read(
        self, scope: str, pod: str, after: int
    ) -> tuple[list[list[float]], list[list], int, bool]:
        """The other pods' pairs of `scope` numbered after `after`, oldest first, as
        [ratio, statistic, f1, top1]; who published each and its own number, as
        [pod, id]; the number to continue after; whether more wait."""
        kept = self._scopes.get(scope, ())
        found: list[list[float]] = []
        origins: list[list] = []
        last = after
        for number, owner, own, ratio, statistic, f1, top1 in kept:
            if number <= after:
                continue
            if len(found) == self.limits.max_reply:
                return found, origins, last, True
            last = number
            if owner != pod:
                found.append([ratio, statistic, f1, top1])
                origins.append([owner, own])
        return found, origins, last, False

    def since(self, scope: str, pod: str, after: int) -> tuple[list[list[float]], int, bool]:
        """`read` without who published the pairs."""
        found, _, last, more = self.read(scope, pod, after)
        return found, last, more

    def stats(self) -> dict:
        return {
            "calibration_scopes": len(self._scopes),
            "calibration_pairs": sum(len(kept) for kept in self._scopes.values()),
            "calibration_pairs_added": self.num_added,
        }
