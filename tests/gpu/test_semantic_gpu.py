"""SemanticMoE on GPUs: the shuffle kernels natively on CUDA vs their references, the rebatch on CUDA
vs CPU, and the distributed semantic suite (dp and tp modes, tiny decoder) over NCCL on 1, 2 and 4 GPUs
(the 4-GPU case where the machine has them)."""

import pytest
import torch

from moelayers.kernels import (
    HAVE_TRITON,
    bucket_positions,
    bucket_positions_reference,
    bucket_positions_triton,
    shuffle_rows,
    shuffle_rows_reference,
    use_triton,
)
from moelayers.schedule import rebatch
from moelayers.testing import run_distributed
from tests.distributed.test_semantic import check_results, run_semantic_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")


@needs_triton
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float16))
@pytest.mark.parametrize("T,N,H", [(1, 1, 8), (37, 40, 200), (4096, 4100, 2048), (300, 512, 7168)])
def test_shuffle_rows_cuda(T, N, H, dtype):
    gen = torch.Generator(device="cuda").manual_seed(T + N + H)
    x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    index = torch.randint(-1, T, (N,), device="cuda", generator=gen)
    assert use_triton(x)
    wide = torch.full((N, H + 16), float("nan"), device="cuda", dtype=dtype)
    got = shuffle_rows(x, index.int(), wide[:, 8:8 + H])
    ref = shuffle_rows_reference(x, index)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert wide[:, :8].isnan().all() and wide[:, 8 + H:].isnan().all()


@needs_triton
@pytest.mark.parametrize("T,R", [(1, 2), (100, 2), (4097, 8), (16384, 8)])
def test_bucket_positions_cuda(T, R):
    gen = torch.Generator(device="cuda").manual_seed(T + R)
    pred = torch.randint(-1, R, (T,), device="cuda", generator=gen)
    conf = torch.randint(0, 50, (T,), device="cuda", generator=gen).float() / 49  # many ties
    conf[: T // 7] = -0.0
    expected = bucket_positions_reference(pred.cpu(), conf.cpu())
    assert torch.equal(bucket_positions_triton(pred, conf).cpu(), expected)
    assert torch.equal(bucket_positions_reference(pred, conf).cpu(), expected)  # CUDA sort path agrees
    assert torch.equal(bucket_positions(pred, conf).cpu(), expected)


@pytest.mark.parametrize("T,R", [(5, 4), (1000, 8), (20000, 8)])
def test_rebatch_cuda_equals_cpu(T, R):
    gen = torch.Generator().manual_seed(T)
    pred = torch.randint(-1, R, (T,), generator=gen)
    pred[: T // 3] = 1
    conf = torch.randint(0, 20, (T,), generator=gen).float() / 19
    cpu, gpu = rebatch(pred, conf, R), rebatch(pred.cuda(), conf.cuda(), R)
    assert torch.equal(cpu.perm, gpu.perm.cpu()) and torch.equal(cpu.capacity, gpu.capacity.cpu())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", (1, 2, 4))
def test_semantic_moe_matches_reference_nccl(world):
    """World 1 runs every case's code path on CUDA (a single chunk); worlds 2 and 4 shuffle across GPUs."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    check_results(run_distributed(run_semantic_cases, world, "cuda", backend="nccl", timeout=500))


@pytest.mark.timeout(300)
def test_forward_tp_second_order_gradients_nccl():
    """A gradient penalty through forward_tp's shuffled collectives over NCCL: the reference's
    second-order gradients (attn_partial's were world-size times too large)."""
    from tests.distributed.test_training_paths import _double_backward_tp

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    assert run_distributed(_double_backward_tp, 2, "cuda", backend="nccl", timeout=240) == [None, None]


@pytest.mark.timeout(300)
def test_forward_tp_verify_tp_residual_nccl():
    """verify_tp_residual's fingerprint of the residual's bits on CUDA (float64 and bfloat16): one
    bit apart on one rank raises on both, equal residuals give the unchecked output."""
    from tests.distributed.test_semantic import _tp_residual_out_of_sync, check_residual_checks

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    check_residual_checks(run_distributed(_tp_residual_out_of_sync, 2, "cuda", backend="nccl", timeout=240))
