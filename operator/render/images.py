"""Runtime container images, in one place.

The repository and tag are ONE setting shared with the Helm chart: the chart's
`runtimeImages.repository` / `runtimeImages.tag` become the operator Deployment's
`HOLEBLEND_RUNTIME_IMAGE_REPOSITORY` / `HOLEBLEND_RUNTIME_IMAGE_TAG`, read once when this
module is imported (the default tag follows the holeblend release, as the chart's
appVersion does). Image names are `<repository>-<variant>:<tag>`, one variant per
Dockerfile target: `runtime-cuda`, `runtime-ascend-a2` (Atlas A2, 910B), `runtime-ascend-a3`
(Atlas A3, 910C) and `runtime-cpu` (holeblend-serve, also the lookup server's image).
Ascend pods default to the A2 image; A3 clusters set `engine.image` to the A3 one.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass

from holeblend_operator.api import AcceleratorType

HOLEBLEND_VERSION = "0.1.0"
IMAGE_REPOSITORY = "ghcr.io/holeblend/runtime"
REPOSITORY_ENV = "HOLEBLEND_RUNTIME_IMAGE_REPOSITORY"
TAG_ENV = "HOLEBLEND_RUNTIME_IMAGE_TAG"
# Dockerfile target runtime-<variant> builds image <repository>-<variant>.
ENGINE_VARIANTS = {
    AcceleratorType.ASCEND: "ascend-a2",
    AcceleratorType.NVIDIA: "cuda",
    AcceleratorType.CPU: "cpu",
}
ASCEND_A3_VARIANT = "ascend-a3"


@dataclass(frozen=True)
class RuntimeImages:
    repository: str = IMAGE_REPOSITORY
    tag: str = HOLEBLEND_VERSION

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "RuntimeImages":
        return cls(
            repository=environ.get(REPOSITORY_ENV) or IMAGE_REPOSITORY,
            tag=environ.get(TAG_ENV) or HOLEBLEND_VERSION,
        )

    def image(self, variant: str) -> str:
        return f"{self.repository}-{variant}:{self.tag}"


RUNTIME_IMAGES = RuntimeImages.from_environ(os.environ)
DEFAULT_ENGINE_IMAGES = {
    accelerator: RUNTIME_IMAGES.image(variant) for accelerator, variant in ENGINE_VARIANTS.items()
}
# The lookup server is a small CPU-only process whatever the engines run on.
DEFAULT_LOOKUP_IMAGE = DEFAULT_ENGINE_IMAGES[AcceleratorType.CPU]


def engine_image(image: str | None, accelerator: AcceleratorType) -> str:
    return image or DEFAULT_ENGINE_IMAGES[accelerator]


def lookup_image(image: str | None) -> str:
    return image or DEFAULT_LOOKUP_IMAGE
