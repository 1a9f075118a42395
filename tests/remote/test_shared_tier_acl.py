"""KV isolation between BlendDeployments in one Redis: each connects as its own ACL user
(`holeblend_contract.shared_tier.acl_rules`), on a real redis-server with ACLs."""

from __future__ import annotations

import secrets
import shlex
import subprocess

import pytest
import redis
import torch

from holeblend_contract.shared_tier import acl_user
from holeblend_operator.cli import main
from holeblend_runtime.kv.shared_tier import SharedTier, SharedTierConfig
from holeblend_runtime.kv.store import SegmentKV
from holeblend_runtime.kv.tiers import KVLayout, kv_to_blob
from holeblend_runtime.lookup_server.processes import RedisProcess

LAYOUT = KVLayout("model-a", "float32", num_layers=2, num_kv_heads=2, head_dim=4)
A, B = "team-a/rag", "team-b/rag"


def printed(*args: str, capsys) -> list[str]:
    """The words `holeblend-operator shared-tier-acl ARGS` prints."""
    assert main(["shared-tier-acl", *args]) == 0
    return shlex.split(capsys.readouterr().out)


@pytest.fixture
def store(tmp_path, capsys):
    """A redis-server whose default user is disabled, and users A and B created with what
    `holeblend-operator shared-tier-acl` prints: A's as an ACL SETUSER command piped into
    redis-cli, B's as an ACL file line (run as ACL SETUSER, which takes the same rules and
    the #hash)."""
    server = RedisProcess().start()
    admin = redis.Redis.from_url(server.url)
    passwords = {deployment: secrets.token_hex(16) for deployment in (A, B)}
    (tmp_path / "a").write_text(passwords[A] + "\n")
    (tmp_path / "b").write_text(passwords[B] + "\n")
    # As docs/shared-tier.md says: the printed command piped into redis-cli.
    command = shlex.join(printed(A, "--password-file", str(tmp_path / "a"), capsys=capsys))
    piped = subprocess.run(
        ["redis-cli", "-p", str(server.port)], input=command + "\n", capture_output=True,
        text=True, timeout=30, check=True,
    )  # fmt: skip
    assert piped.stdout.strip() == "OK", piped
    line = printed(B, "--aclfile", "--password-file", str(tmp_path / "b"), capsys=capsys)
    assert line[:2] == ["user", acl_user(B)] and passwords[B] not in line
    admin.execute_command("ACL", "SETUSER", *line[1:])
    admin.execute_command("ACL", "SETUSER", "admin", "on", ">admin-pass", "~*", "&*", "+@all")
    admin.execute_command("ACL", "SETUSER", "default", "off")
    yield server, passwords
    server.stop()


def segment(key: str = "seg") -> SegmentKV:
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, 3, LAYOUT.head_dim)
    return SegmentKV(key, torch.randn(shape), torch.randn(shape), torch.arange(3), "model-a")


def tier(server, deployment: str, user: str, password: str) -> SharedTier:
    config = SharedTierConfig(server.url, deployment, timeout_s=1.0, breaker_failures=100)
    return SharedTier(config, password=password, username=user)


def test_the_printed_acl_needs_the_real_password(capsys):
    words = printed(A, capsys=capsys)
    assert words[:6] == ["ACL", "SETUSER", acl_user(A), "reset", "on", "><password>"]
    assert f"~holeblend:{A}:kv:*" in words and "-@all" in words


def test_each_deployment_reads_and_writes_only_its_own_keys(store):
    server, passwords = store
    a = tier(server, A, acl_user(A), passwords[A])
    b = tier(server, B, acl_user(B), passwords[B])
    assert a.put_pieces("seg", [kv_to_blob(segment(), A)])
    assert b.put_pieces("seg", [kv_to_blob(segment(), B)])
    assert a.get_checked(LAYOUT.header("seg")) is not None
    assert b.get_checked(LAYOUT.header("seg")) is not None

    # A pod of A that claims to be B (HOLEBLEND_DEPLOYMENT overridden) still holds A's
    # credentials: every read and write of B's keys is refused by the store.
    impostor = tier(server, B, acl_user(A), passwords[A])
    assert impostor.get_blob("seg") is None
    assert impostor.put_pieces("seg", [kv_to_blob(segment(), B)]) is False
    assert impostor.stats.errors_by_kind == {"NoPermissionError": 2}
    # The same with a raw client: no read, no write, no delete, no key listing.
    raw = redis.Redis.from_url(server.url, username=acl_user(A), password=passwords[A])
    for command in (
        ("GET", b.redis_key("seg")),
        ("SET", b.redis_key("seg"), b"poison"),
        ("DEL", b.redis_key("seg")),
        ("KEYS", "*"),
        ("FLUSHALL",),
        ("CONFIG", "GET", "*"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            raw.execute_command(*command)
    # B's segment is intact.
    assert b.get_checked(LAYOUT.header("seg")) is not None
    # And without any credentials nothing is served.
    anonymous = redis.Redis.from_url(server.url)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.get(b.redis_key("seg"))


def test_a_blob_copied_into_another_deployments_keys_is_refused(store):
    """Even where ACLs let a blob through (an administrator's copy, a shared user), the
    reader's identity check refuses another deployment's blob."""
    server, passwords = store
    a = tier(server, A, acl_user(A), passwords[A])
    b = tier(server, B, acl_user(B), passwords[B])
    assert a.put_pieces("seg", [kv_to_blob(segment(), A)])
    admin = redis.Redis.from_url(server.url, username="admin", password="admin-pass")
    admin.set(b.redis_key("seg"), admin.get(a.redis_key("seg")))
    assert b.get_checked(LAYOUT.header("seg")) is None
    assert b.stats.bad_blobs == 1
