"""File formats, one module each, knowing nothing of codebooks: `source` (folder or hub
id), `safetensors_reader` (headers first, then one tensor at a time), `writer` (shards at
planned offsets, the journal), `output` (the partial folder, lock, resume, swap),
`format` (the checkpoint format, defined once), `manifest`, `integrity` and `checkpoint`
(reading a checkpoint back, checked), `calibration` (the calibration file), `seeds`
(the SEEDS file) and `text` (evaluation and calibration text).
"""

from __future__ import annotations

from tq_cli._lazy import lazy_face

__getattr__ = lazy_face(__name__, {
    "FORMAT_VERSION": "format",
    "converted_entries": "format",
    "open_source": "safetensors_reader",
    "read_manifest": "manifest",
    "read_calibration": "calibration",
})
__all__ = ["FORMAT_VERSION", "converted_entries", "open_source", "read_calibration",
           "read_manifest"]
