"""The operator's kopf progress storage clears essences exactly as kopf's does, copying less."""

import copy

import kopf
import pytest

from holeblend_operator.handlers import ANNOTATION_PREFIX, CopyFreeProgress

ESSENCES = [
    {"spec": {"replicas": 2}, "metadata": {"labels": {"a": "b"}}},
    {"spec": {"replicas": 2}, "metadata": {"annotations": {}, "labels": {}}},
    {"spec": {}, "metadata": {"annotations": {f"{ANNOTATION_PREFIX}/reconcile-create": "{}"}}},
    {"spec": {}, "metadata": {"annotations": {"other/x": "1", f"{ANNOTATION_PREFIX}/y": "2"}}},
]


@pytest.mark.parametrize("essence", ESSENCES)
def test_clear_matches_kopf(essence):
    ours = CopyFreeProgress(prefix=ANNOTATION_PREFIX).clear(essence=copy.deepcopy(essence))
    theirs = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX).clear(essence=essence)
    assert ours == theirs
