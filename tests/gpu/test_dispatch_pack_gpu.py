"""The dispatch-pack kernel natively on CUDA vs its torch reference."""

import pytest
import torch

from moelayers.dispatch.comm import RowLayout
from moelayers.kernels import dispatch_pack_reference, dispatch_pack_triton
from tests.unit.test_dispatch_pack import _case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("t,h,k,r", [(1, 8, 1, 1), (257, 2048, 8, 2), (4096, 2048, 6, 4), (100, 136, 8, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dispatch_pack_cuda(t, h, k, r, dtype):
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in _case(t, h, k, r, dtype, seed=t)]
    x, dest_map, dest_rank, dest_slot, weights, n = args
    layout = RowLayout(((h, dtype), (k, dtype), (k, torch.int32)))
    bufs = [torch.full((n, layout.row_bytes), 0xAB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    dispatch_pack_reference(x, dest_map, dest_rank, dest_slot, weights, *layout.views(bufs[0]))
    dispatch_pack_triton(x, dest_map, dest_rank, dest_slot, weights, *layout.views(bufs[1]))
    torch.cuda.synchronize()
    assert torch.equal(bufs[0], bufs[1])
