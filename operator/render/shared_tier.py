"""What the engine pods learn about the shared KV tier besides blend.json: env vars.

The URL (no password) is in the runtime ConfigMap. The password comes from the Secret key
in spec.blend.kv.sharedPasswordSecret, never from the ConfigMap; the deployment's
"namespace/name" prefixes every shared-tier key (holeblend_contract.shared_tier). With
`sharedIdentity: deployment` the pods connect as the deployment's own ACL user.
"""

from holeblend_contract.shared_tier import DEPLOYMENT_ENV, PASSWORD_ENV, USER_ENV, acl_user
from holeblend_operator.api import BlendDeployment, SharedIdentity


def shared_tier_env(bd: BlendDeployment) -> list[dict]:
    kv = bd.spec.blend.kv
    if kv.shared_url is None:
        return []
    deployment = f"{bd.metadata.namespace}/{bd.metadata.name}"
    env = [{"name": DEPLOYMENT_ENV, "value": deployment}]
    if kv.shared_identity == SharedIdentity.DEPLOYMENT:
        env.append({"name": USER_ENV, "value": acl_user(deployment)})
    secret = kv.shared_password_secret
    if secret is not None:
        ref = {"secretKeyRef": {"name": secret.name, "key": secret.key}}
        env.append({"name": PASSWORD_ENV, "valueFrom": ref})
    return env
