"""The running operator renders its pods with its own --pod-listen-address."""

import copy

from holeblend_operator import handlers
from holeblend_operator.settings import OperatorSettings
from tests.operator.test_pod_listen_address import MANIFEST


def test_the_operator_renders_its_pods_with_its_listen_address():
    owner = copy.deepcopy(MANIFEST)
    owner["metadata"] |= {"uid": "u1", "generation": 1}
    _, children = handlers.Operator(OperatorSettings(pod_listen_address="::")).prepared(owner)
    for child in children:
        if child["kind"] == "Deployment":
            args = child["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[args.index("--host") + 1] == "::"
