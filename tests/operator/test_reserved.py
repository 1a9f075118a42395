"""What a tenant may not set on the engine pods, refused alike by the models and the CRD.

Every spelling vLLM's FlexibleArgumentParser (argparse with abbreviations, '_' read as '-',
dotted JSON keys) or holeblend-serve's parser reads as a reserved flag is refused by the
pydantic model and by the CRD's CEL rule (as tests/operator/crd_validation.py evaluates it),
with the field and the fix named; flags that never break the blend pass both.
"""

import itertools
import re

import pydantic
import pytest

from holeblend_operator import reserved
from holeblend_operator.api import BlendDeployment, format_validation_error
from holeblend_operator.render import engine as engine_render
from holeblend_operator.render import serve as serve_render
from tests.operator.crd_validation import api_server_errors
from tests.operator.test_render import MINIMAL, engine_container, make_bd

SECRET = {"name": "kv-cache", "key": "password"}


def _manifest(**spec) -> dict:
    return {**MINIMAL, "spec": {**MINIMAL["spec"], **spec}}


def _engine(**engine) -> dict:
    return _manifest(engine=engine)


def _model_problem(manifest: dict) -> str | None:
    try:
        BlendDeployment.model_validate(manifest)
    except pydantic.ValidationError as error:
        return format_validation_error(error)
    return None


def _refused_by_both(manifest: dict, field: str, server_field: str, fix: str) -> None:
    problem = _model_problem(manifest)
    assert problem is not None, "the model accepted it"
    assert problem.startswith(field) and fix in problem, problem
    errors = api_server_errors(manifest)
    assert any(e.startswith(server_field) and fix in e for e in errors), errors


def _accepted_by_both(manifest: dict) -> None:
    assert _model_problem(manifest) is None
    assert api_server_errors(manifest) == []


# --- flags ---------------------------------------------------------------------------------


def _spellings(flag: str) -> list[list[str]]:
    """Every way vLLM or argparse reads `flag`: as written, '=', '_', abbreviated, dotted."""
    if not flag.startswith("--"):
        return [[flag, "2"], [f"{flag}=2"], [flag[:2], "2"], [f"{flag}.x=1"]]
    body = flag[2:]
    underscored = "--" + body.replace("-", "_")
    forms = [[flag], [flag, "1"], [f"{flag}=1"], [underscored, "1"], [f"{underscored}=1"]]
    forms += [[flag[: len(flag) - cut]] for cut in (1, len(body) // 2, len(body) - 1) if cut]
    forms += [[f"{flag[:-1]}=1"], [f"{flag}.key=1"], [f"{flag}.key", "1"], [f"{flag}.a.b+=x"]]
    forms += [[f"{underscored[:-1]}.key=1"]]
    return forms


SPELLINGS = sorted(
    {tuple(args) for flag in reserved.RESERVED_FLAGS for args in _spellings(flag)}
) + [
    ("--por=9000",),
    ("--hos=0.0.0.0",),
    ("--kv-transfer", "{}"),
    ("--kv-transfer-config.kv_connector=Other",),
    ("--kv_transfer_config.kv_connector_extra_config.holeblend_config", "/tmp/x.json"),
    ("--tensor-parallel", "2"),
    ("-t", "2"),
    ("-tp=2",),
    ("--no-enforce-eager",),
    ("--no_enforce_eager",),
    ("--enable-prefix-caching",),
    ("--no-disable-hybrid-kv-cache-manager",),
    ("--block-size", "16"),
    ("--b=16",),
    ("--kv-offloading-size", "4"),
    ("--config", "/models/evil.yaml"),
    ("--conf=/models/evil.yaml",),
    ("--max-num-seqs", "8", "--port", "9000"),
]

FREE = [
    ["--max-num-seqs", "8"],
    ["--gpu-memory-utilization=0.8"],
    ["--gpu_memory_utilization", "0.85"],
    ["--max-num-batched-tokens", "4096"],
    ["--enable-lora"],
    ["--config-format", "hf"],
    ["--compilation-config.mode=0"],
    ["-O0"],
    ["-pp", "1"],
    ["--queue-size", "16"],
    ["x"],  # a value, not a flag
    ["--", "x"],
    ["9000"],
]


@pytest.mark.parametrize("args", SPELLINGS, ids=" ".join)
def test_every_spelling_of_a_reserved_flag_is_refused_by_the_model_and_the_crd(args):
    flag = next(reserved.reserved_flag(a) for a in args if reserved.reserved_flag(a))
    fix = "from engine.extraArgs"
    _refused_by_both(_engine(extraArgs=list(args)), "spec.engine.extraArgs", "", fix)
    problem = _model_problem(_engine(extraArgs=list(args)))
    assert flag in problem or any(a in problem for a in args)
    assert reserved.RESERVED_FLAGS[flag].removeprefix("nothing: ") in problem
    assert any(
        e.startswith(".spec.engine.extraArgs") and "use their spec fields" in e
        for e in api_server_errors(_engine(extraArgs=list(args)))
    )


@pytest.mark.parametrize("args", FREE, ids=" ".join)
def test_flags_that_never_break_the_blend_pass(args):
    _accepted_by_both(_engine(extraArgs=args))


def test_the_messages_say_how_the_argument_reaches_the_flag():
    def problem(arg):
        return reserved.reserved_flag_problem([arg])

    assert problem("--por=9000").startswith("'--por=9000' abbreviates --port")
    assert "set engine.port instead" in problem("--por=9000")
    assert problem("--kv-transfer-config.kv_role=x").startswith(
        "'--kv-transfer-config.kv_role=x' sets a key of --kv-transfer-config"
    )
    assert problem("--tensor_parallel_size").startswith("'--tensor_parallel_size' is reserved")
    assert "eager mode" in problem("--no-enforce-eager")


def test_the_cel_pattern_and_the_python_check_agree():
    corpus = {a for args in SPELLINGS for a in args} | {a for args in FREE for a in args}
    for flag in reserved.RESERVED_FLAGS:
        corpus |= {flag[:n] + tail for n in range(1, len(flag) + 1) for tail in ("", "=1", ".k")}
        corpus |= {flag + "x", flag + "-x", "-" + flag, flag.upper()}
    for arg in sorted(corpus):
        by_regex = re.search(reserved.RESERVED_FLAG_PATTERN, arg) is not None
        assert by_regex == (reserved.reserved_flag(arg) is not None), arg


def _rendered_flags(args: list[str]) -> set[str]:
    return {a for a in args if a.startswith("-")}


@pytest.mark.parametrize("accelerator", ["ascend", "nvidia", "cpu"])
def test_every_flag_the_operator_renders_is_reserved(accelerator):
    bd = make_bd(
        accelerator={"type": accelerator, "count": 0 if accelerator == "cpu" else 1},
        model={
            "name": "m",
            "maxModelLen": 4096,
            "source": {"hub": {"id": "org/m", "revision": "main"}},
        },
    )
    args = engine_container(bd)["args"]
    if accelerator != "cpu":
        assert args == engine_render.vllm_args(bd)
    else:
        assert args == serve_render.serve_args(bd)
    flags = _rendered_flags(args)
    assert flags and flags <= set(reserved.RESERVED_FLAGS), flags - set(reserved.RESERVED_FLAGS)


def test_the_negation_of_every_boolean_flag_the_blend_sets_is_reserved():
    for flag in engine_render.BLEND_FLAGS:
        positive = flag.replace("--no-", "--", 1)
        assert positive in reserved.RESERVED_FLAGS
        assert "--no-" + positive[2:] in reserved.RESERVED_FLAGS


@pytest.mark.parametrize(
    "args",
    [
        ["--por=9000"],
        ["--po", "9000"],
        ["--hos", "1.2.3.4"],
        ["--conf", "/x.json"],
        ["--queue", "3"],
        ["--torch-thread=1"],
    ],
)
def test_holeblend_serve_refuses_abbreviations(args):
    from holeblend_runtime.serve.settings import parse_settings

    with pytest.raises(SystemExit) as exit_:
        parse_settings(["--config", "/c.json", *args], {})
    assert exit_.value.code == 2


def test_every_spelling_holeblend_serve_reads_as_an_operator_flag_is_refused():
    from holeblend_runtime.serve.settings import parse_settings

    base = {"config": "/c.json", "host": "0.0.0.0", "port": "8000"}
    for name in base:
        flag = f"--{name}"
        for args in itertools.chain(_spellings(flag), [[flag[:n], "1"] for n in range(3, 7)]):
            try:
                settings = parse_settings([*args, *(["1"] if len(args) == 1 else [])], {})
            except SystemExit:
                continue  # holeblend-serve does not read it
            changed = str(getattr(settings, name)) != base[name] or name == "config"
            if changed:
                assert reserved.reserved_flag_problem(args), args


# --- environment ---------------------------------------------------------------------------

OPERATOR_ENV = [
    "HOLEBLEND_DEPLOYMENT",
    "HOLEBLEND_SHARED_TIER_PASSWORD",
    "HOLEBLEND_CONFIG",
    "HOLEBLEND_METRICS_PORT",
    "HOLEBLEND_SERVE_PORT",
    "HOLEBLEND_SHARED_TIER_USER",
    "HOLEBLEND_SOMETHING_NEW",
    "CUDA_VISIBLE_DEVICES",
    "HOME",
]


@pytest.mark.parametrize("name", OPERATOR_ENV)
def test_the_operators_variables_are_refused_by_the_model_and_the_crd(name):
    manifest = _engine(env=[{"name": name, "value": "x"}])
    _refused_by_both(manifest, "spec.engine.env", ".spec.engine.env", "from engine.env")


@pytest.mark.parametrize(
    "name",
    [
        "HOLEBLEND_ENGINE_URL",
        "HOLEBLEND_ATTENTION",
        "HOLEBLEND_CACHE_DIR",
        "HOLEBLEND_SERVE_QUEUE_SIZE",
        "HF_HOME",
        "VLLM_LOGGING_LEVEL",
        "holeblend_lowercase_is_another_variable",
    ],
)
def test_documented_user_variables_pass(name):
    _accepted_by_both(_engine(env=[{"name": name, "value": "x"}]))


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"accelerator": {"type": "nvidia", "count": 1, "networkInterface": "eth0"}},
        {"accelerator": {"type": "cpu", "count": 0}},
        {"blend": {"kv": {"sharedUrl": "redis://kv:6379/0", "sharedPasswordSecret": SECRET}}},
    ],
)
def test_every_variable_the_operator_renders_is_refused_in_engine_env(spec):
    container = engine_container(make_bd(**spec))
    names = [var["name"] for var in container["env"]]
    assert names
    for name in names:
        assert reserved.reserved_env_problem([name]), name


# --- annotations ---------------------------------------------------------------------------

DENIED_ANNOTATIONS = [
    "container.apparmor.security.beta.kubernetes.io/engine",
    "seccomp.security.alpha.kubernetes.io/pod",
    "container.seccomp.security.alpha.kubernetes.io/engine",
    "io.kubernetes.cri-o.Devices",
    "io.kubernetes.cri-o.userns-mode",
    "io.kubernetes.cri.untrusted-workload",
    "io.katacontainers.config.hypervisor.kernel",
    "dev.gvisor.spec.mount.shared.share",
]


@pytest.mark.parametrize("key", DENIED_ANNOTATIONS)
def test_security_annotations_are_refused_by_the_model_and_the_crd(key):
    manifest = _engine(podAnnotations={key: "unconfined"})
    fix = "from engine.podAnnotations"
    _refused_by_both(manifest, "spec.engine.podAnnotations", ".spec.engine.podAnnotations", fix)
    assert "remove it from engine.podAnnotations" in _model_problem(manifest)


@pytest.mark.parametrize(
    "key", ["hami.io/vnpu-mode", "cluster-autoscaler.kubernetes.io/safe-to-evict", "team"]
)
def test_scheduler_annotations_pass(key):
    _accepted_by_both(_engine(podAnnotations={key: "true"}))


# --- shared-tier URL -----------------------------------------------------------------------

CREDENTIAL_URLS = [
    "redis://:hunter2@kv:6379/0",
    "redis://default:hunter2@kv:6379/0",
    "redis://kv:6379/0?password=hunter2",
    "redis://kv:6379/0?PassWord=hunter2",
    "redis://kv:6379/0?db=0&password=hunter2",
    "rediss://kv:6380/0?ssl_password=hunter2",
    "redis://kv:6379/0?username=admin",
    "redis://kv:6379/0?USERNAME=admin",
    "redis://kv:6379/0?%70assword=hunter2",
    "valkey://kv:6379/0?auth_token=x",
    "redis://kv:6379/0#password=hunter2",
    "redis://kv:6379/0#hunter2",
]


@pytest.mark.parametrize("url", CREDENTIAL_URLS)
def test_shared_urls_with_credentials_are_refused_by_the_model_and_the_crd(url):
    manifest = _manifest(
        blend={"kv": {"sharedUrl": url, "sharedPasswordSecret": SECRET, "sharedIdentity": "shared"}}
    )
    # The CRD's rule sits on kv (fieldPath .sharedUrl), and names the field in its message.
    _refused_by_both(manifest, "spec.blend.kv.sharedUrl", ".spec.blend.kv", "sharedPasswordSecret")
    assert "ConfigMap" in _model_problem(manifest)
    errors = api_server_errors(manifest)
    assert any("kv.sharedUrl must not carry credentials" in e for e in errors), errors


@pytest.mark.parametrize(
    "url",
    [
        "redis://kv:6379/0",
        "rediss://kv:6380/1?ssl_cert_reqs=required",
        "redis://kv:6379/0?socket_timeout=2&health_check_interval=30",
    ],
)
def test_shared_urls_without_credentials_pass(url):
    _accepted_by_both(_manifest(blend={"kv": {"sharedUrl": url, "sharedPasswordSecret": SECRET}}))
