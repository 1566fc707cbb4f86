import pytest
import torch

from tq_cli.quant.rotation import make_rotation, verify
from tq_cli.quant.spec import RotationSpec
from tq_kernels.rotation import hadamard_blocks, walsh_hadamard


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("b", [1, 2, 8, 64])
def test_fast_walsh_hadamard_matches_matrix(b: int) -> None:
    x = torch.randn(3, b, dtype=torch.float64)
    assert torch.allclose(walsh_hadamard(x), x @ sylvester(b))


def test_blocks_cover_awkward_sizes() -> None:
    assert hadamard_blocks(576, 128)[-1] == (512, 64)
    assert hadamard_blocks(200, 64)[-1] == (192, 8)
    for n in (1, 7, 72, 200, 576, 1000):
        blocks = hadamard_blocks(n, 64)
        assert sum(s for _, s in blocks) == n
        assert all(s & (s - 1) == 0 for _, s in blocks)


@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
@pytest.mark.parametrize("n", [96, 200, 576])
def test_rotation_is_orthogonal_and_invertible(kind: str, n: int) -> None:
    rot = make_rotation(RotationSpec(kind=kind, seed=3), n, 64)  # type: ignore[arg-type]
    eye = torch.eye(n)
    r = rot.rotate(eye)  # the matrix R itself
    assert torch.allclose(r @ r.T, eye, atol=1e-5)
    x = torch.randn(4, n)
    assert torch.allclose(rot.unrotate(rot.rotate(x)), x, atol=1e-5)


def test_material_is_deterministic_and_verifiable() -> None:
    a = make_rotation(RotationSpec(kind="orthogonal", seed=7), 200, 64)
    b = make_rotation(RotationSpec(kind="orthogonal", seed=7), 200, 64)
    c = make_rotation(RotationSpec(kind="orthogonal", seed=8), 200, 64)
    assert a.matrix is not None and b.matrix is not None and c.matrix is not None
    assert torch.equal(a.matrix, b.matrix) and not torch.equal(a.matrix, c.matrix)
    assert verify(a)
    assert not verify(type(a)(a.kind, a.n, a.block, 8, matrix=a.matrix, tail=a.tail))
