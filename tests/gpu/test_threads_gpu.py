"""One layer called from two threads on a GPU: its forwards take turns (moelayers/layers/turns.py)."""

import pytest
import torch

from tests.unit.test_threads import check_shared_layer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kw", [{}, {"capacity": 64}, {"capacity": 64, "cuda_graph": True}],
                         ids=["eager", "capacity", "cuda_graph"])
def test_a_shared_layer_checks_each_threads_input_gpu(kw):
    # (a CUDA graph needs the grouped GEMM's bf16)
    check_shared_layer(kw, "cuda", calls=200, dtype=torch.bfloat16 if kw.get("cuda_graph") else torch.float32)
