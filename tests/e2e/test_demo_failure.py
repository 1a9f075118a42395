"""`make demo` when the engine never becomes ready: the demo shows the end of the
operator's and the pods' logs before its temporary directory, and the logs, are removed."""

import sys

from holeblend_devtools import closed_loop, demo

# An engine that cannot start: says why, then exits (the kubelet restarts it with backoff).
FAILING = "import sys; print('cannot load the model: no such file /models/m'); sys.exit(1)"


def test_a_demo_whose_engine_never_gets_ready_shows_the_logs(tmp_path, capsys):
    container = {"name": "engine", "command": [sys.executable], "args": ["-I", "-c", FAILING]}
    labels = {"app": "engine"}
    engine = {
        "metadata": {"name": "smollm2-demo-engine", "namespace": "default"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }
    with closed_loop.LiveStack(tmp_path) as stack:
        stack.cluster.call(stack.cluster.api.put_object("apps/v1/deployments", engine))
        stack.cluster.wait_for(
            lambda: [p.restarts for p in stack.kubelet.pods.values()] == [1], timeout=30
        )
        demo.show_logs(stack)
    shown = capsys.readouterr().out
    assert "the end of the operator's log" in shown
    (pod,) = stack.kubelet.pods.values()
    assert f"the end of pod {pod.name}'s log" in shown
    assert "cannot load the model: no such file /models/m" in shown


def test_a_stack_whose_operator_cannot_start_stops_what_it_started(tmp_path, monkeypatch):
    """The kubelet and the emulator started before the operator: its failed start must not
    leave them running (the kubelet's thread would keep its pods alive)."""
    monkeypatch.setattr(closed_loop, "operator_command", lambda *_: [str(tmp_path / "missing")])
    stack = closed_loop.LiveStack(tmp_path)
    try:
        stack.__enter__()
    except FileNotFoundError:
        pass
    else:
        stack.__exit__()
        raise AssertionError("the missing operator started")
    assert stack.kubelet is not None and stack.kubelet._stopped.is_set()
