"""/healthz fails when kopf's watches keep failing certificate verification: kopf reads the
cluster CA bundle only when it logs in, so after the CA rotates only a restart brings its
watch streams back."""

import asyncio
import contextlib
import ssl

import aiohttp
import aiohttp.web
import kopf
from kopf._cogs.clients import auth, watching
from kopf._cogs.structs import credentials, references

from holeblend_operator import health
from holeblend_operator.health import HealthServer
from tests.operator.test_kube_credentials import NEW_CA, OLD_CA, SERVER_CERTIFICATE, SERVER_KEY

PODS = references.Resource(group="", version="v1", plural="pods", namespaced=True)


@contextlib.asynccontextmanager
async def kopf_after_a_ca_rotation(tmp_path):
    """kopf logged in to an API server while the mounted CA bundle held the old CA only; the
    server's certificate is from the new CA, which the bundle holds now as well."""
    (tmp_path / "server.crt").write_text(SERVER_CERTIFICATE)
    (tmp_path / "server.key").write_text(SERVER_KEY)
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")
    runner = aiohttp.web.AppRunner(aiohttp.web.Application())
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0, ssl_context=serving).start()
    ca_file = tmp_path / "ca.crt"
    ca_file.write_text(OLD_CA)
    server = f"https://127.0.0.1:{runner.addresses[0][1]}"
    vault = credentials.Vault()
    await vault.populate({"login": kopf.ConnectionInfo(server=server, ca_path=str(ca_file))})
    auth.vault_var.set(vault)
    contexts = vault.extended(auth.APIContext, "contexts")  # what kopf's requests use
    async with contextlib.aclosing(contexts):
        await anext(contexts)  # logged in: its TLS context built from the bundle as it is
    ca_file.write_text(OLD_CA + NEW_CA)  # the kubelet updates the bundle as the CA rotates
    try:
        yield
    finally:
        await vault.close()
        await runner.cleanup()


async def watch_once() -> list:
    """One pass of kopf's watch of pods, which kopf repeats for ever after it ends."""
    settings = kopf.OperatorSettings()
    settings.networking.error_backoffs = (0.01,)
    stream = watching.continuous_watch(
        settings=settings,
        resource=PODS,
        namespace=None,
        operator_pause_waiter=asyncio.get_running_loop().create_future(),
    )
    return [event async for event in stream]


async def probe(health_server: HealthServer) -> int:
    url = f"http://127.0.0.1:{health_server.port}/healthz"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


@contextlib.asynccontextmanager
async def started_health_server(clock):
    operator = asyncio.create_task(asyncio.Event().wait())  # kopf's operator, still running
    ready = asyncio.Event()
    ready.set()
    health_server = HealthServer(operator, ready, clock=clock)
    await health_server.start("127.0.0.1", 0)
    try:
        yield health_server
    finally:
        operator.cancel()
        await health_server.stop()


async def probes_while_watching(tmp_path, watched_at: list[float], probed_at: float) -> int:
    """/healthz's status at `probed_at` (seconds) after kopf's watch failed at each of
    `watched_at`."""
    now = [0.0]
    async with (
        kopf_after_a_ca_rotation(tmp_path),
        started_health_server(lambda: now[0]) as health_server,
    ):
        for at in watched_at:
            now[0] = at
            assert await watch_once() == []  # failed, silently: no event, no error raised
        now[0] = probed_at
        return await probe(health_server)


async def test_watches_failing_certificate_verification_for_good_make_the_operator_unhealthy(
    tmp_path,
):
    limit = health.CERTIFICATE_FAILURE_S
    assert await probes_while_watching(tmp_path, [0.0, 30.0], 30.0) == 200
    watched_at = [t * limit / 10 for t in range(11)]  # again and again, never trusted
    assert await probes_while_watching(tmp_path, watched_at, limit) == 503


async def test_certificate_failures_that_stopped_leave_the_operator_healthy(tmp_path):
    limit = health.CERTIFICATE_FAILURE_S
    quiet = health.CERTIFICATE_QUIET_S
    # failing for longer than the limit, but with a pause in between that ended the first run
    watched_at = [0.0, limit / 2, limit / 2 + quiet + 1, limit + quiet]
    assert await probes_while_watching(tmp_path, watched_at, limit + quiet) == 200
    # and the failures ended a while ago
    assert await probes_while_watching(tmp_path, [0.0, limit], limit + quiet + 1) == 200
