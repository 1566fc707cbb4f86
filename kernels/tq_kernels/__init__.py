"""tq_kernels: the packed weight layout, Triton kernels and their pure-torch twins.

The packed layout (`tq_kernels.packing`) is owned here and imported by the checkpoint
writer in `tq_cli`, so the writer and the kernels can never disagree. Triton is imported
lazily by the kernel modules; importing this package never needs it.
"""

from tq_kernels.packing import PLANES, pack_codes, packed_row_bytes, padded_length, unpack_codes
from tq_kernels.rotation import (
    hadamard_blocks,
    hadamard_rotate,
    hadamard_unrotate,
    orthogonal_rotate,
    orthogonal_unrotate,
    walsh_hadamard,
)

__all__ = [
    "PLANES",
    "hadamard_blocks",
    "hadamard_rotate",
    "hadamard_unrotate",
    "orthogonal_rotate",
    "orthogonal_unrotate",
    "pack_codes",
    "packed_row_bytes",
    "padded_length",
    "unpack_codes",
    "walsh_hadamard",
]
