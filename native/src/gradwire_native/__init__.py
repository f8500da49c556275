"""gradwire's native data path (C++17 via nanobind). gradwire imports it through gradwire/native.py only."""

from gradwire_native._core import (
    HEADER_SIZE,
    Credit,
    FloorShape,
    Flow,
    FrameDecoder,
    MAX_CONTROL_BYTES,
    ServerLoop,
    WorkerLoop,
    add_into,
    decode_header,
    encode_header,
    floor_push_pull,
    floor_serve,
    narrow,
    widen,
    worker_push_pull,
)

__version__ = "0.1.0"

__all__ = [
    "Credit",
    "FloorShape",
    "Flow",
    "FrameDecoder",
    "HEADER_SIZE",
    "MAX_CONTROL_BYTES",
    "ServerLoop",
    "WorkerLoop",
    "__version__",
    "add_into",
    "decode_header",
    "encode_header",
    "floor_push_pull",
    "floor_serve",
    "narrow",
    "widen",
    "worker_push_pull",
]
