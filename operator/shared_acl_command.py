"""`holeblend-operator shared-tier-acl NAMESPACE/NAME`: the Redis/Valkey ACL user of one
BlendDeployment, for whoever runs the shared tier.

With `kv.sharedIdentity: deployment` (the default) the engine pods of a BlendDeployment
connect to the shared tier as the user `holeblend:NAMESPACE/NAME`, with the password in the
Secret key `kv.sharedPasswordSecret` names. This command prints what creates that user in
the store, limited to the deployment's keys and to the commands the runtime sends
(`holeblend_contract.shared_tier.acl_rules`):

    holeblend-operator shared-tier-acl rag/llama-8b
    ACL SETUSER holeblend:rag/llama-8b reset on ><password> ~holeblend:rag/llama-8b:kv:* ...

`--password-file FILE` puts the password in (for `redis-cli`); `--aclfile` prints the line of
an ACL file instead (`user ... on #<sha256 of the password> ...`, no password in clear).
"""

import argparse
import hashlib
import shlex
import sys

from holeblend_contract.shared_tier import acl_rules, acl_user

PLACEHOLDER = "<password>"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "shared-tier-acl",
        help="print the shared tier's ACL user of one BlendDeployment",
        allow_abbrev=False,
    )
    parser.add_argument("deployment", help="NAMESPACE/NAME of the BlendDeployment")
    parser.add_argument("--password-file", help="read the password from this file (its first line)")
    parser.add_argument(
        "--aclfile",
        action="store_true",
        help="print an ACL file line (the password as its SHA-256; needs --password-file)",
    )
    parser.set_defaults(run=run)


def acl_setuser(deployment: str, password: str) -> list[str]:
    """The words of `ACL SETUSER` that creates (or resets) the deployment's user."""
    return ["ACL", "SETUSER", acl_user(deployment), "reset", "on", f">{password}",
            *acl_rules(deployment)]  # fmt: skip


def aclfile_line(deployment: str, password: str) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    return " ".join(["user", acl_user(deployment), "on", f"#{digest}", *acl_rules(deployment)])


def run(args: argparse.Namespace) -> int:
    try:
        password = _password(args.password_file)
        if args.aclfile:
            if password is None:
                raise ValueError("--aclfile needs --password-file (the line holds its hash)")
            print(aclfile_line(args.deployment, password))
        else:
            print(shlex.join(acl_setuser(args.deployment, password or PLACEHOLDER)))
    except (ValueError, OSError) as error:
        print(f"holeblend-operator shared-tier-acl: {error}", file=sys.stderr)
        return 2
    return 0


def _password(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path) as file:
        password = file.readline().rstrip("\n")
    if not password or any(c.isspace() for c in password):
        raise ValueError(f"{path}: the password must be one line without spaces")
    return password
