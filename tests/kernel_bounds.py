"""An index past a kernel's buffer, on any device (CPU under TRITON_INTERPRET=1, and CUDA)."""

import pytest
import torch


def check_kernels_stay_in_bounds(device: torch.device) -> None:
    """An index past the buffer wrote the neighbouring rows of a view (permute, dispatch pack) or
    read them as data (unpermute-combine, shuffle). The references raise IndexError (on CPU); the
    Triton kernels (no host check) skip such rows and read them as zeros, the memory around the
    view untouched."""
    from moelayers.dispatch.comm import RowLayout
    from moelayers.kernels import (dispatch_pack_reference, dispatch_pack_triton, permute_reference, permute_triton,
                                   shuffle_rows_reference, shuffle_rows_triton, unpermute_combine_reference,
                                   unpermute_combine_triton)

    def t(data, **kw):
        return torch.tensor(data, device=device, **kw)

    cpu = device.type == "cpu"  # a CUDA reference's index error is a device assert: not tried there
    base = torch.zeros(8, 3, device=device)
    out = permute_triton(torch.ones(2, 3, device=device), t([[4], [1]]), base[:4])  # row 4 of 4
    assert base[4:].abs().sum() == 0 and torch.equal(out[1], torch.ones(3, device=device))
    assert out[[0, 2, 3]].abs().sum() == 0
    if cpu:
        with pytest.raises(IndexError):
            permute_reference(torch.ones(1, 3), torch.tensor([[4]]), torch.zeros(4, 3))

    base = torch.arange(15., device=device).view(5, 3)
    got = unpermute_combine_triton(base[:3], t([[3, 1]]), None)
    assert torch.equal(got, base[1:2])  # row 3 read as zeros, not as base[3]
    if cpu:
        with pytest.raises(IndexError):
            unpermute_combine_reference(base[:3], torch.tensor([[3]]), None)

    base = torch.arange(12., device=device).view(4, 3)
    assert shuffle_rows_triton(base[:2], t([2, 0])).tolist() == [[0.0] * 3, [0.0, 1.0, 2.0]]
    if cpu:
        with pytest.raises(IndexError):
            shuffle_rows_reference(base[:2], torch.tensor([2, 0]))

    lay = RowLayout(((3, torch.float32), (1, torch.float32), (1, torch.int32)))
    buf = torch.zeros(4, lay.row_bytes, dtype=torch.uint8, device=device)
    args = (torch.ones(1, 3, device=device), t([[2]]), t([[0]]), t([[5]]), t([[0.5]]))
    dispatch_pack_triton(*args, *lay.views(buf[:2]))  # row 2 of a 2-row payload
    assert not buf.any()
    if cpu:
        with pytest.raises(IndexError):
            dispatch_pack_reference(*args, *lay.views(torch.zeros(2, lay.row_bytes, dtype=torch.uint8)))
