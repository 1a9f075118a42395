"""The inline proxy's calibration, shared by a deployment's pods through its lookup server.

The inline proxy (inline_proxy.py) estimates quality from each blend's own statistic
once it holds `MIN_PAIRS` (statistic, shadow score) pairs at a ratio. On its own a pod
that starts has none, and at saturation its shadows score a few a minute: it would give
the tuner nothing for minutes after every start, restart or scale-out. The pods of a
deployment already share a lookup server (the segment index); it keeps their pairs too
(lookup_server/calibration.py), so a new pod starts with the deployment's calibration.

1. `calibration_scope`: what two pods' pairs must share to be comparable. The statistic
   (`STATISTIC_VERSION` of its definition) is a squared K deviation at the check layer,
   so its scale is the model's, the dtype it computes in, the stored KV dtype's and, at
   tensor parallelism, the head shard's; the cached KV it is measured against depends on
   the segment context and the store policy; which tokens it compares, on the selection,
   the filter layers and the shortest cached segment.
2. `SharedCalibration`, a daemon thread (never on the request path): at start, then
   every `interval_s` and soon after this pod's shadow scored a pair, it merges the other
   pods' new pairs into the inline proxy (`pairs_get`, from where it left off) and
   publishes the pairs scored here since the last call (`pairs_add`), each with a number
   of this pod's own. A lookup server that is down or slow costs nothing but the
   sharing: the pod calibrates on its own pairs, and keeps the unsent ones (at most
   `MAX_PENDING`) until the server answers. A server that restarted (a new `epoch`, seen
   before this pod publishes) lost the pairs: the pod publishes its own recent ones
   again, once, and reads the others' from the start, keeping only those it did not
   receive before. A pair is known by who published it and its number there, never by
   its values: equal pairs of different requests (a repeated prompt, or a blend that
   recomputed every compared token: statistic 0) all count. A lookup server that does not
   answer those numbers (an older one) leaves only the values to go by: a pair equal to
   one received before is then taken for it. A pair received is checked as the server
   checks those it stores; one off its range is dropped, the rest of its reply kept.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import secrets
import threading
from collections.abc import Iterable

from holeblend_runtime.lookup_server import wire
from holeblend_runtime.lookup_server.client import ClientConfig, LookupClient
from holeblend_runtime.model.threads import serial_thread
from holeblend_runtime.quality.inline_proxy import STATISTIC_VERSION, InlineProxy

log = logging.getLogger(__name__)

# Seconds between two exchanges with the lookup server (a pair scored here wakes it).
INTERVAL_S = 30.0
# Pairs scored here and not yet published, kept at most while the server does not answer
# (beyond that the oldest are dropped; a calibration keeps only the newest 256 per ratio).
MAX_PENDING = 4096
# This pod's own published pairs kept to publish again to a restarted server.
MAX_OWN = 1024
# Pairs received remembered at most, so that a restarted server's pairs, which the other
# pods publish again, are not counted twice.
MAX_SEEN = 16384
# `pairs_get` calls in one exchange at most (each answers up to the server's max_reply).
MAX_READS = 8
# The lookup client of the exchange: off the request path, so a slow server may take a
# second before the exchange gives up until the next one.
CLIENT = ClientConfig(timeout_ms=1000.0, retries=1, breaker_failures=3, breaker_open_s=30.0)

Pair = tuple[float, float, float, float]  # ratio, statistic, f1, top1
Numbered = tuple[int, Pair]  # this pod's own number of a pair, the pair


def calibration_scope(
    model_id: str,
    kv_dtype: str,
    tensor_parallel_size: int,
    blend,
    model_dtype: str | None = None,
) -> str:
    """The scope under which pods share pairs: equal only where statistics compare.
    `kv_dtype`: the dtype the tiers hold documents' KV in; `model_dtype`: the one the
    model computes in (None: `kv_dtype` where the tiers hold the model's own, kv.storeDtype
    auto, else "?"). `blend`: the blend's settings (the contract's `BlendSettings` or the
    runtime's `BlendConfig`). A scope longer than the lookup server takes names the model
    by a hash of its id."""
    filters = ",".join(str(layer) for layer in blend.filter_layers) or "-"
    if isinstance(getattr(blend, "cache_after_system", None), bool):  # BlendConfig
        context = "afterSystem" if blend.cache_after_system else "alone"
        store_dtype = blend.kv_store_dtype
    else:  # BlendSettings
        context, store_dtype = str(blend.segment_context), str(blend.kv.store_dtype)
    if model_dtype is None:
        model_dtype = kv_dtype if store_dtype == "auto" else "?"
    rest = (
        f"|{kv_dtype}|model-{model_dtype}|tp{tensor_parallel_size}|{blend.selection}"
        f"|check{blend.check_layer}|filter{filters}|{context}|{blend.store_policy}"
        f"|min{blend.min_segment_tokens}"
    )
    scope = f"stat{STATISTIC_VERSION}|{model_id}{rest}"
    if len(scope) > wire.Limits().max_name_chars:
        digest = hashlib.sha256(model_id.encode()).hexdigest()[:32]
        scope = f"stat{STATISTIC_VERSION}|sha256-{digest}{rest}"
    return scope


class SharedCalibration:
    """Publishes this pod's pairs and merges the other pods' into `inline` (it takes
    over `inline.on_pair`); `start` runs the exchange on a daemon thread, `exchange` is
    one round (the thread's, or a caller's when no thread runs)."""

    def __init__(
        self,
        client: LookupClient,
        scope: str,
        pod: str,
        inline: InlineProxy,
        interval_s: float = INTERVAL_S,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        self.client, self.scope, self.pod, self.inline = client, scope, pod, inline
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._pending: collections.deque[Numbered] = collections.deque(maxlen=MAX_PENDING)
        self._own: collections.deque[Numbered] = collections.deque(maxlen=MAX_OWN)
        self._numbers = itertools.count(1)  # this pod's own numbers of its pairs
        # The greatest number published so far: a pair numbered up to it is a re-send.
        self._published_through = 0
        self._after = 0
        self._epoch: str | None = None
        self._seen: dict[tuple, None] = {}  # pairs received (`_identity`), oldest first
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        inline.on_pair = self.publish

    @classmethod
    def to(
        cls, url: str, scope: str, pod: str, inline: InlineProxy, **options
    ) -> SharedCalibration:
        """Sharing through the lookup server at `url`, on a connection of its own. The
        name it publishes under is `pod` and a random suffix: a container that restarts
        keeps its host name and may keep its pid, and must still read back the pairs its
        earlier life published (a pod never reads its own)."""
        name = f"{pod}-{secrets.token_hex(4)}"
        return cls(LookupClient(url, CLIENT), scope, name, inline, **options)

    def start(self) -> SharedCalibration:
        self._thread = serial_thread(self._run, "holeblend-calibration")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread after a last exchange (this pod's unsent pairs go out)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.client.close()

    def publish(self, ratio: float, statistic: float, f1: float, top1: float) -> None:
        """A pair this pod's shadow scored (the inline proxy's `on_pair`): sent soon. One
        the server would refuse (off its range) is dropped here: sent, it would refuse
        the whole batch, again at every exchange."""
        try:
            pair = wire.check_pair((ratio, statistic, f1, top1))
        except wire.WireError as error:
            log.warning("calibration pair not shared: %s", error.message)
            return
        with self._lock:
            self._pending.append((next(self._numbers), pair))
        self._wake.set()

    def _run(self) -> None:
        while True:
            # Read before the exchange: a stop asked while it runs may come after it took
            # the pending pairs, and the pairs scored since still need one more.
            is_last = self._stopping
            try:
                self.exchange()
            except Exception:  # sharing never stops the pod
                log.exception("sharing the quality proxies' calibration failed")
            if is_last:
                return
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def exchange(self) -> bool:
        """Read the other pods' new pairs, then publish the pending ones; False when the
        lookup server did not answer (what is unsent stays pending). Reading first, a
        restart is seen before anything is sent to the restarted server, so that each
        pair reaches it once."""
        return self._receive() and self._send()

    def _send(self) -> bool:
        with self._lock:
            numbered = list(self._pending)
            self._pending.clear()
        if not numbered:
            return True
        reply = self.client.call(
            {
                "op": "pairs_add",
                "scope": self.scope,
                "pod": self.pod,
                "pairs": [list(pair) for _, pair in numbered],
                "ids": [number for number, _ in numbered],
            }
        )
        if reply is None:
            with self._lock:  # back in front of those published meanwhile
                self._requeue(numbered)
            self._count_failure()
            return False
        with self._lock:
            self._own.extend(numbered)
        # Pairs sent again to a restarted server were counted when first published: the
        # count is of the pairs this pod scored. Each send takes every pending pair, so
        # the numbers past the greatest one published are the first sends.
        first_sends = sum(1 for number, _ in numbered if number > self._published_through)
        self._published_through = max(self._published_through, *(n for n, _ in numbered))
        self._count("published", first_sends)
        return True

    def _receive(self) -> bool:
        """At most `MAX_READS` calls, a restart's read from the start among them: a server
        that reports a new epoch on every reply costs one exchange, not a call per reply
        for ever."""
        for _ in range(MAX_READS):
            reply = self.client.call(
                {"op": "pairs_get", "scope": self.scope, "pod": self.pod, "after": self._after}
            )
            if reply is None:
                self._count_failure()
                return False
            if reply["epoch"] != self._epoch:
                restarted = self._epoch is not None
                self._epoch, self._after = reply["epoch"], 0
                if restarted:
                    # The server lost every pair (and numbers them anew): this pod's own
                    # go out again with the pending ones (`exchange` sends them next),
                    # and the others' are read from the start; this reply was for the
                    # old numbering.
                    log.info("the lookup server restarted; publishing calibration pairs again")
                    with self._lock:
                        self._requeue(self._own)
                        self._own.clear()
                    continue
            pairs = _checked(reply["pairs"])
            ids = reply.get("ids")
            if not (isinstance(ids, list) and len(ids) == len(pairs)):
                ids = [None] * len(pairs)  # an older server: only the values tell
            fresh = [
                pair
                for pair, origin in zip(pairs, ids, strict=True)
                if pair is not None and self._is_new(pair, origin)
            ]
            for ratio, statistic, f1, top1 in fresh:
                self.inline.add_shared(ratio, statistic, f1, top1)
            self._count("received", len(fresh))
            self._after = reply["last"]
            if not reply["more"]:
                break
        return True

    def _requeue(self, numbered: Iterable[Numbered]) -> None:
        """Under the lock: `numbered` (older) in front of the pending pairs. Beyond
        `MAX_PENDING` the oldest go: `extendleft` on a full deque drops from the other end,
        the pairs scored last."""
        self._pending = collections.deque([*numbered, *self._pending], maxlen=MAX_PENDING)

    def _is_new(self, pair: Pair, origin: object) -> bool:
        """Whether `pair` was not received before: after a server restart the others'
        pairs come again (they publish them anew). A pair is known by `origin`, the
        [pod, number] it was published under; by its values only where the server or its
        publisher did not number it."""
        identity = _identity(pair, origin)
        if identity in self._seen:
            return False
        self._seen[identity] = None
        if len(self._seen) > MAX_SEEN:
            del self._seen[next(iter(self._seen))]
        return True

    def _count(self, direction: str, n: int) -> None:
        if n and self.inline.metrics is not None:
            self.inline.metrics.shared_pairs.labels(direction=direction).inc(n)

    def _count_failure(self) -> None:
        if self.inline.metrics is not None:
            self.inline.metrics.share_failures.inc()


def _checked(items: list) -> list[Pair | None]:
    """The received pairs as the server checks the pairs it stores, None in place of one
    off its range: a server of another version, or one that did not check, must not put a
    NaN or a ratio outside [0, 1] into the calibration, nor stop the pairs after it."""
    pairs: list[Pair | None] = []
    errors = []
    for i, item in enumerate(items):
        try:
            pairs.append(wire.check_pair(item, f"pairs[{i}]"))
        except wire.WireError as error:
            pairs.append(None)
            errors.append(error.message)
    if errors:
        log.warning("%d calibration pairs received dropped, first: %s", len(errors), errors[0])
    return pairs


def _identity(pair: Pair, origin: object) -> tuple:
    """What tells a received pair from the others: its publisher and its number there, or
    its values when it came without a number."""
    if isinstance(origin, list | tuple) and len(origin) == 2:
        pod, number = origin
        if isinstance(pod, str) and isinstance(number, int) and not isinstance(number, bool):
            return ("published", pod, number)
    return ("values", *pair)
