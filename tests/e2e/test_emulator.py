"""The Kubernetes API emulator itself: kubectl works against it, lookups stay O(1), watches resume."""

import asyncio
import json
import subprocess
import time

import aiohttp

from holeblend_devtools.emulator import Fault
from tests.e2e.conftest import BD, KUBECTL, create, example

CM_PATH = "/api/v1/namespaces/default/configmaps"


def kubectl(cluster, *args, check=True):
    env = {"KUBECONFIG": cluster.kubeconfig, "HOME": cluster.kubeconfig + ".home"}
    extra = ["--validate=false"] if args[0] in ("apply", "create") else []
    done = subprocess.run(
        [KUBECTL, args[0], *extra, *args[1:]], env=env, capture_output=True, text=True, check=False
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_kubectl_apply_get_scale_and_delete_a_blend_deployment(cluster, tmp_path):
    manifest = tmp_path / "bd.yaml"
    manifest.write_text(json.dumps(example()))
    assert "created" in kubectl(cluster, "apply", "-f", str(manifest)).stdout
    table = kubectl(cluster, "get", "bd").stdout
    assert table.split()[:7] == ["NAME", "MODE", "RATIO", "READY", "HIT%", "F1", "AGE"]
    assert "hole" in table  # the CRD's default for spec.blend.mode, applied by the emulator
    kubectl(cluster, "scale", "bd/smollm2-demo", "--replicas=2")
    assert cluster.get(BD, "default", "smollm2-demo")["spec"]["replicas"] == 2
    assert cluster.get(BD, "default", "smollm2-demo")["metadata"]["generation"] == 2
    kubectl(cluster, "delete", "bd", "smollm2-demo")
    assert "No resources found" in kubectl(cluster, "get", "bd").stderr


def test_status_subresource_is_separate_from_the_main_resource(cluster):
    body = create(cluster, example())
    path = f"/apis/{BD.rpartition('/')[0]}/namespaces/default/blenddeployments/smollm2-demo"

    async def patch(url, payload):
        async with aiohttp.ClientSession(cluster.url) as session:
            headers = {"Content-Type": "application/merge-patch+json"}
            async with session.patch(url, data=json.dumps(payload), headers=headers) as response:
                return await response.json()

    main = asyncio.run(
        patch(path, {"status": {"phase": "Ready"}, "metadata": {"labels": {"a": "b"}}})
    )
    assert "status" not in main and main["metadata"]["labels"] == {"a": "b"}
    status = asyncio.run(
        patch(path + "/status", {"status": {"phase": "Ready"}, "spec": {"replicas": 9}})
    )
    assert status["status"]["phase"] == "Ready" and status["spec"]["replicas"] == 1
    assert status["metadata"]["generation"] == body["metadata"]["generation"]  # status: no bump


def test_lookups_do_not_slow_down_as_objects_accumulate(cluster):
    async def create_and_get(session, start, count):
        began = time.perf_counter()
        for index in range(start, start + count):
            body = {"metadata": {"name": f"cm-{index}"}, "data": {"k": "v"}}
            async with session.post(CM_PATH, json=body) as response:
                assert response.status == 201
            async with session.get(f"{CM_PATH}/cm-{index}") as response:
                assert response.status == 200
        return time.perf_counter() - began

    async def measure():
        # Best of three batches at each end, so that a burst of load elsewhere does not decide.
        async with aiohttp.ClientSession(cluster.url) as session:
            first = min([await create_and_get(session, i * 100, 100) for i in range(3)])
            await create_and_get(session, 300, 1500)
            last = min([await create_and_get(session, 1800 + i * 100, 100) for i in range(3)])
            return first, last

    first, last = asyncio.run(measure())
    # kmock as shipped scans every stored object on each fetch and create, so these would
    # grow with the store; indexed, the last 200 cost about what the first 200 did.
    assert last < 3 * first, (first, last)


def test_watch_resumes_from_a_resource_version_without_replaying_everything(cluster):
    async def watch_from(version):
        async with aiohttp.ClientSession(cluster.url) as session:
            url = f"{CM_PATH}?watch=true&resourceVersion={version}&timeoutSeconds=1"
            async with session.get(url) as response:
                return [json.loads(line) for line in (await response.text()).splitlines()]

    async def scenario():
        async with aiohttp.ClientSession(cluster.url) as session:
            for name in ("a", "b"):
                async with session.post(CM_PATH, json={"metadata": {"name": name}}) as response:
                    created = await response.json()
        return await watch_from(int(created["metadata"]["resourceVersion"]) - 1)

    events = asyncio.run(scenario())
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b")]


def test_scripted_faults_answer_before_anything_is_stored(cluster):
    cluster.api.faults.append(Fault("create", "configmaps", status=503, times=1))

    async def post_twice():
        async with aiohttp.ClientSession(cluster.url) as session:
            codes = []
            for _ in range(2):
                async with session.post(CM_PATH, json={"metadata": {"name": "x"}}) as response:
                    codes.append(response.status)
            return codes

    assert asyncio.run(post_twice()) == [503, 201]


def test_an_autoscaler_can_put_the_scale_subresource(cluster):
    create(cluster, example())
    path = f"/apis/{BD.rpartition('/')[0]}/namespaces/default/blenddeployments/smollm2-demo/scale"

    async def put_scale():
        async with aiohttp.ClientSession(cluster.url) as session:
            async with session.get(path) as response:
                scale = await response.json()
            scale["spec"]["replicas"] = 5
            async with session.put(path, json=scale) as response:
                return response.status, await response.json()

    code, scale = asyncio.run(put_scale())
    assert code == 200 and scale["kind"] == "Scale" and scale["spec"]["replicas"] == 5
    assert cluster.get(BD, "default", "smollm2-demo")["spec"]["replicas"] == 5
