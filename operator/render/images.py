"""Default container images, in one place; the tag follows the holeblend release."""

from holeblend_operator.api import AcceleratorType

HOLEBLEND_VERSION = "0.1.0"
IMAGE_REPOSITORY = "ghcr.io/holeblend/runtime"

DEFAULT_ENGINE_IMAGES = {
    AcceleratorType.ASCEND: f"{IMAGE_REPOSITORY}-ascend:{HOLEBLEND_VERSION}",
    AcceleratorType.NVIDIA: f"{IMAGE_REPOSITORY}-cuda:{HOLEBLEND_VERSION}",
    AcceleratorType.CPU: f"{IMAGE_REPOSITORY}-cpu:{HOLEBLEND_VERSION}",
}
# The lookup server is a small CPU-only process whatever the engines run on.
DEFAULT_LOOKUP_IMAGE = DEFAULT_ENGINE_IMAGES[AcceleratorType.CPU]


def engine_image(image: str | None, accelerator: AcceleratorType) -> str:
    return image or DEFAULT_ENGINE_IMAGES[accelerator]


def lookup_image(image: str | None) -> str:
    return image or DEFAULT_LOOKUP_IMAGE
