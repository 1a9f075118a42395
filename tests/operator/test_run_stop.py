"""How `holeblend-operator run` stops: at once, with nothing of its own left for kopf to
wait on."""

import asyncio
import logging
import pathlib

import kmock
import yaml

from holeblend_devtools.emulator import ClusterEmulator, write_kubeconfig
from holeblend_operator import run_command, settings

ROOT = pathlib.Path(__file__).parents[2]


async def test_a_stop_leaves_kopf_no_task_of_ours_to_wait_for(tmp_path, monkeypatch, caplog):
    """kopf ignores the tasks it finds running when it starts and, at exit, waits 5 s for
    any other still running before it cancels them: the heap-trimming task, started after
    kopf, held every stop (a restart, a Recreate rollout) 5 s for nothing."""
    async with ClusterEmulator() as api, kmock.Server(api) as server:
        with open(ROOT / "crds" / "blenddeployments.blend.holeblend.io.yaml") as file:
            api.install_crd(yaml.safe_load(file))
        kubeconfig = tmp_path / "kubeconfig"
        write_kubeconfig(str(kubeconfig), str(server.url).rstrip("/"))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        config = settings.OperatorSettings(health_host="127.0.0.1", health_port=0)
        stop = asyncio.Event()
        caplog.set_level(logging.DEBUG, logger="kopf")
        serving = asyncio.create_task(run_command.serve(config, stop))
        while not api.take_requests():  # kopf has started, logged in and watches
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(serving, 30)
    hung = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Hung tasks")]
    assert hung and all("skipped: no tasks given" in message for message in hung), hung
