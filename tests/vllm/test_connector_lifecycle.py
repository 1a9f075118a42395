"""The connector's start and end outside an engine: the reason a worker without the model
gives (holeblend not installed, or vLLM's `VLLM_PLUGINS` leaving its plugin out), and
`shutdown`, which waits a few seconds for the shadow's last score so that its pair goes
out with the shared calibration's last exchange, however long the pod's API server takes
to answer the shadow."""

import http.server
import json
import threading
import types
from importlib.metadata import entry_points

import pytest
import torch

from holeblend_runtime.blend.config import BlendConfig
from holeblend_runtime.kv.store import LocalKVStore
from holeblend_runtime.lookup_server import wire
from holeblend_runtime.lookup_server.server import LookupServer
from holeblend_runtime.quality.shared_calibration import SharedCalibration
from holeblend_runtime.vllm_connector import connector, plugin
from holeblend_runtime.vllm_connector.settings import ConnectorSettings
from holeblend_runtime.vllm_connector.shadow import VllmShadowRequest

SEP, EOS = 9, 0
SCOPE = "lifecycle-test"
# A blended request the shadow scores: prompt, answer, question, ratio; its inline
# statistic makes the score a calibration pair.
SCORED = VllmShadowRequest((1, 2, 3), (11, 12), "q", 0.15, inline_statistic=0.5)


# --- a worker without the model -------------------------------------------------------


def test_the_plugin_name_is_holeblends_vllm_entry_point():
    plugins = entry_points(group="vllm.general_plugins")
    names = {ep.name for ep in plugins if ep.value.startswith(plugin.__name__ + ":")}
    assert names == {connector.PLUGIN_NAME}


@pytest.mark.parametrize(
    ("allowed", "says"),
    [
        ("lora_filesystem_resolver", "VLLM_PLUGINS='lora_filesystem_resolver' leaves out"),
        ("", "VLLM_PLUGINS='' leaves out"),
        ("lora_filesystem_resolver, holeblend", "leaves out holeblend's"),  # vLLM: " holeblend"
        (None, "install holeblend in the vLLM environment"),
        ("lora_filesystem_resolver,holeblend", "install holeblend in the vLLM environment"),
    ],
)
def test_a_worker_without_the_model_says_whether_vllm_plugins_left_holeblend_out(
    monkeypatch, allowed, says
):
    """vLLM loads only the general plugins `VLLM_PLUGINS` names (split at commas, as is)
    when it is set: holeblend is installed then, and the fix is the variable."""
    monkeypatch.setattr(plugin, "_loaded", {})
    if allowed is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=16))
    side = connector._WorkerSide(config, ConnectorSettings(), LocalKVStore(1 << 20))
    try:
        with pytest.raises(RuntimeError, match="the model was not handed over") as refused:
            side.prepare()
    finally:
        side.close()
    message = str(refused.value)
    assert says in message
    assert "VLLM_PLUGINS" in message and "'holeblend'" in message


# --- shutdown ---------------------------------------------------------------------------


class ApiServer:
    """The pod's API server as the shadow sees it: its completions agree with every
    answer token, each answered once `release` is set (`entered`: a request came)."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.entered.set()
                owner.release.wait(10)
                ranks = [{str(t): {"logprob": -0.1, "rank": 1}} for t in body["prompt"][1:]]
                logprobs = [None, *ranks]
                choice = {"prompt_logprobs": logprobs, "token_ids": [EOS]}
                data = json.dumps({"choices": [choice]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def close(self):
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


class InProcessLookup:
    """The calibration's lookup client, answered by an in-process lookup server."""

    def __init__(self, server: LookupServer):
        self.server, self.is_closed = server, False

    def call(self, message: dict) -> dict | None:
        status, _, body = self.server.handle("POST", wire.RPC_PATH, wire.encode(message))
        return wire.decode_reply(body) if status == 200 else None

    def close(self) -> None:
        self.is_closed = True  # the calibration's `stop` closes it last


@pytest.fixture
def pod(monkeypatch):
    """A scheduler-side connector whose shadow scores through an `ApiServer` and whose
    calibration pairs go to an in-process lookup server."""
    tokenizer = types.SimpleNamespace(
        encode=lambda text, add_special_tokens: [SEP],
        decode=lambda ids, skip_special_tokens: " ".join(f"w{i}" for i in ids),
        eos_token_id=EOS,
    )
    monkeypatch.setattr(connector, "_text_tokenizer", lambda vllm_config: tokenizer)
    model_config = types.SimpleNamespace(
        model="m", revision=None, dtype=torch.float32, served_model_name="m"
    )
    vllm_config = types.SimpleNamespace(
        model_config=model_config, parallel_config=types.SimpleNamespace(tensor_parallel_size=1)
    )
    api, lookup = ApiServer(), LookupServer()
    client = InProcessLookup(lookup)
    settings = ConnectorSettings(
        blend=BlendConfig(min_segment_tokens=2), shadow_sample_rate=1.0, engine_url=api.url
    )
    side = connector._SchedulerSide(vllm_config, settings, LocalKVStore(1 << 20))
    side.shared_calibration = SharedCalibration(client, SCOPE, "pod-a", side.inline).start()
    hole_blend = object.__new__(connector.HoleBlendConnector)
    hole_blend._scheduler, hole_blend._worker, hole_blend.store = side, None, None
    try:
        yield types.SimpleNamespace(
            connector=hole_blend, shadow=side.shadow, api=api, lookup=lookup, client=client
        )
    finally:
        api.close()


def published(lookup: LookupServer) -> list[list[float]]:
    """The pairs another pod of the deployment reads."""
    return lookup.calibration.since(SCOPE, "pod-b", 0)[0]


def test_shutdown_publishes_the_pair_the_shadow_scores_while_it_stops(pod):
    assert pod.shadow.offer(SCORED) == "queued"
    assert pod.api.entered.wait(5)
    threading.Timer(0.3, pod.api.release.set).start()  # answered once shutdown began
    pod.connector.shutdown()
    assert pod.shadow.outcomes["scored"] == 1
    assert published(pod.lookup) == [[0.15, 0.5, 1.0, 1.0]]
    assert pod.client.is_closed


def test_shutdown_waits_for_the_shadow_only_briefly_and_still_stops_the_calibration(
    pod, monkeypatch
):
    """The API server may be going down too: a shadow it does not answer is left to its
    thread after `SHADOW_CLOSE_S`, and the calibration stops all the same."""
    monkeypatch.setattr(connector, "SHADOW_CLOSE_S", 0.1)
    assert pod.shadow.offer(SCORED) == "queued"
    assert pod.api.entered.wait(5)
    stopping = threading.Thread(target=pod.connector.shutdown, daemon=True)
    stopping.start()
    stopping.join(8)  # the API server holds the shadow's request for 10 s
    assert not stopping.is_alive() and not pod.api.release.is_set()
    assert pod.client.is_closed and published(pod.lookup) == []
