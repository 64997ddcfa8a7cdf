"""Real Horovod jobs (2 ranks, Gloo) on the Adam path (docs/methods.md#adam-and-adamw).

The PyTorch worker (workers/torch_adam.py) trains every method with hvd_sparse.torch.optim.AdamW
linked through ``optimizer=`` and checks on every rank and step that the optimizer applied what
the compressor delivered, Adam of the average during the dense steps, exact error feedback on the
rank's own Adam update afterwards, and identical weights (workers/adam_checks.py); then a
checkpoint resume, nonfinite="raise", a learning-rate schedule, bfloat16 parameters and the
warning about torch's AdamW stepping without the path.
"""

from __future__ import annotations

import pytest

from tests.multiproc.launch import assert_passed, launch

pytestmark = pytest.mark.multiproc

SIZE = 2
TORCH_CONFIGS = ("exdyna/model/union", "micro/model/union", "deft/model/union", "lags/groups/gather",
                 "topk/tensor/gather", "topk/model/union", "dgc/model/gather", "randomk/model/shared",
                 "gaussiank/tensor/gather", "threshold/tensor/union", "exdyna/model/shared-v",
                 "lags/groups/shared-v")


@pytest.mark.timeout(300)
def test_torch_adam_path():
    stdout = assert_passed(launch("torch_adam.py", SIZE, "gloo", timeout=280), SIZE)
    for line in [*(f"CHECKED torch/{config}" for config in TORCH_CONFIGS), "CHECKED resume",
                 "CHECKED nonfinite", "CHECKED schedule", "CHECKED bf16", "CHECKED warning"]:
        assert stdout.count(f"{line} rank=") == SIZE, line


TF_CONFIGS = ("exdyna/model/union", "deft/model/union", "lags/groups/gather", "topk/model/union",
              "micro/model/union", "exdyna/model/shared-v")


@pytest.mark.timeout(420)
def test_tensorflow_adam_path():
    """The TensorFlow worker (workers/tf_adam.py): the same checks through
    DistributedGradientTape, then model.fit with Horovod's Keras optimizer, the refusals and the
    warning."""
    stdout = assert_passed(launch("tf_adam.py", SIZE, "gloo", timeout=400), SIZE)
    for line in [*(f"CHECKED tf/{config}" for config in TF_CONFIGS), "CHECKED fit", "CHECKED refused",
                 "CHECKED warning"]:
        assert stdout.count(f"{line} rank=") == SIZE, line
