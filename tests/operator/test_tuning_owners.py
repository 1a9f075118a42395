"""The tuner's driver with many owners: one whose metrics read hangs (a slow Prometheus, an
API server answering Retry-After) holds up only its own evaluation."""

import asyncio
import collections
import contextlib
import copy
import time
import types

import aiohttp.web

from holeblend_operator import metrics
from holeblend_operator.host_paths import DEFAULT_HOST_PATH_PREFIXES
from holeblend_operator.render import engine_name
from holeblend_operator.tuning_loop import TuningLoop
from holeblend_operator.tuning_sources import Target
from tests.operator.test_tuning_sources import metrics_page, servers, vector

SPEC = {
    "model": {"name": "m", "source": {"hub": {"id": "org/m"}}},
    "accelerator": {"type": "cpu", "count": 0},
    "blend": {"recomputeRatio": 0.15},
}
SLOW, FAST = ("ns", "slow"), ("ns", "fast")
WAIT_S = 10.0  # a bound for a hang, never reached when the loop works


class _Client:
    """BlendDeployments by name; a status patch replaces the fields it names, and sets
    the owner's event."""

    def __init__(self, specs: dict):
        self.bodies = {
            key: {
                "apiVersion": "blend.holeblend.io/v1alpha1",
                "kind": "BlendDeployment",
                "metadata": {"name": key[1], "namespace": key[0], "generation": 1, "uid": key[1]},
                "spec": spec,
                "status": {},
            }
            for key, spec in specs.items()
        }
        self.reads = collections.Counter()
        self.written = {key: asyncio.Event() for key in specs}

    async def list(self, kind, namespace, selector):
        """One ready engine pod at 127.0.0.1, on the port its spec gives."""
        ready = [{"type": "Ready", "status": "True"}]
        return [
            {
                "metadata": {"name": "slow-engine-0"},
                "status": {"podIP": "127.0.0.1", "conditions": ready},
            }
        ]

    async def get(self, kind, namespace, name):
        self.reads[(namespace, name)] += 1
        return copy.deepcopy(self.bodies[(namespace, name)])

    async def patch_status(self, namespace, name, patch):
        body = self.bodies[(namespace, name)]
        body["status"] = body["status"] | patch
        self.written[(namespace, name)].set()
        return copy.deepcopy(body)


class _Operator:
    def __init__(self, client):
        self.client = client
        self.owners = {key: types.SimpleNamespace(interval=60.0) for key in client.bodies}
        self.settings = types.SimpleNamespace(
            peering=None, host_path_prefixes=DEFAULT_HOST_PATH_PREFIXES
        )
        self._locks = collections.defaultdict(asyncio.Lock)

    @contextlib.asynccontextmanager
    async def lock(self, key):
        async with self._locks[key]:
            yield

    def keep_owner(self, key, body):
        pass

    def request_tuned(self, key):
        pass


def _read_through(prometheus_urls: dict) -> dict:
    return {key: SPEC | {"tuning": {"prometheusUrl": url}} for key, url in prometheus_urls.items()}


class _Observed(TuningLoop):
    """The loop as it is; `ended` is set when an evaluation ends, and `settle` waits for
    the tasks that ran evaluations."""

    def __init__(self, operator):
        super().__init__(operator)
        self.ended = asyncio.Event()
        self.evaluations = set()

    async def tune(self, key):
        self.evaluations.add(asyncio.current_task())
        try:
            return await super().tune(key)
        finally:
            self.ended.set()

    async def settle(self, *tasks) -> None:
        others = self.evaluations - {asyncio.current_task()}
        await asyncio.gather(*tasks, *others, return_exceptions=True)
        if self._session is not None:
            await self._session.close()


def _due(loop: TuningLoop, *keys) -> None:
    """The owners' last evaluations were an interval ago."""
    for key in keys:
        loop._last[key] = time.monotonic() - 120


async def test_an_owner_whose_prometheus_hangs_does_not_hold_up_the_others():
    """The slow owner comes first; its Prometheus answers only when the test says so. The
    fast owner's decision is written meanwhile, and the slow one's when it answers."""
    async with servers(2) as ((slow, fast), _):
        asked, answer = asyncio.Event(), asyncio.Event()

        async def hang(request):
            asked.set()
            await answer.wait()
            return aiohttp.web.Response(text=vector(), content_type="application/json")

        slow.respond = hang
        fast.answer = (200, vector(), "application/json")
        client = _Client(_read_through({SLOW: slow.url, FAST: fast.url}))
        loop = _Observed(_Operator(client))
        _due(loop, SLOW, FAST)
        tick = asyncio.create_task(loop.tick())
        try:
            await asyncio.wait_for(client.written[FAST].wait(), WAIT_S)
            assert asked.is_set() and not client.written[SLOW].is_set()
            answer.set()
            await asyncio.wait_for(client.written[SLOW].wait(), WAIT_S)
            await tick
        finally:
            answer.set()
            await loop.settle(tick)
            metrics.TUNING.forget(SLOW)
            metrics.TUNING.forget(FAST)
    for key in (SLOW, FAST):
        assert client.bodies[key]["status"]["tuning"]["history"][-1]["direction"] == "hold"


async def test_an_owner_is_not_evaluated_again_while_its_last_evaluation_runs():
    """Due again while its read still hangs: a second evaluation beside the first would
    read and write the same owner twice at once."""
    async with servers(1) as ((slow,), _):
        asked, answer = asyncio.Event(), asyncio.Event()

        async def hang(request):
            asked.set()
            await answer.wait()
            return aiohttp.web.Response(text=vector(), content_type="application/json")

        slow.respond = hang
        client = _Client(_read_through({SLOW: slow.url}))
        loop = _Observed(_Operator(client))
        _due(loop, SLOW)
        first = asyncio.create_task(loop.tick())
        try:
            await asyncio.wait_for(asked.wait(), WAIT_S)
            _due(loop, SLOW)
            await asyncio.wait_for(loop.tick(), WAIT_S)
            assert client.reads[SLOW] == 1  # the first evaluation's read, and no other
            answer.set()
            await asyncio.wait_for(client.written[SLOW].wait(), WAIT_S)
        finally:
            answer.set()
            await loop.settle(first)
            metrics.TUNING.forget(SLOW)


async def test_tuning_switched_off_while_a_scrape_hangs_leaves_no_scrape_history():
    """Switched off while its engine pod's /metrics is slow to answer: the scrape history
    is dropped after that evaluation ends, not before it (when the evaluation would keep
    the late answer, and the first window after switching on again would count the pause)."""
    async with servers(1) as ((pod,), session):
        asked, answer = asyncio.Event(), asyncio.Event()

        async def hang(request):
            asked.set()
            await answer.wait()
            return aiohttp.web.Response(text=metrics_page(18, 20), content_type="text/plain")

        pod.respond = hang
        client = _Client({SLOW: SPEC | {"engine": {"port": pod.port}}})
        operator = _Operator(client)
        loop = _Observed(operator)
        _due(loop, SLOW)
        first = asyncio.create_task(loop.tick())
        try:
            await asyncio.wait_for(asked.wait(), WAIT_S)
            operator.owners[SLOW] = types.SimpleNamespace(interval=None)  # switched off
            client.bodies[SLOW]["spec"] = SPEC | {"tuning": {"enabled": False}}
            await asyncio.wait_for(loop.tick(), WAIT_S)
            answer.set()
            await asyncio.wait_for(loop.ended.wait(), WAIT_S)
            await asyncio.wait_for(loop.tick(), WAIT_S)
            pod.respond = None
            pod.answer = (200, metrics_page(990, 1100), "text/plain")
            urls = {"slow-engine-0": f"{pod.url}/metrics"}
            seen = await loop._scrape.read(Target("ns", engine_name("slow"), urls), 0.15, 600)
        finally:
            answer.set()
            await loop.settle(first)
            metrics.TUNING.forget(SLOW)
    assert seen.num_samples == 0  # its first sight since tuning was switched off
