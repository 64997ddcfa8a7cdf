"""The DDP face: every hvd_sparse method as a DistributedDataParallel communication hook.

    import hvd_sparse.torch.ddp as ddp
    model = DistributedDataParallel(model)
    state = ddp.ExDyna(density=0.001, named_parameters=model.module.named_parameters())
    model.register_comm_hook(state, ddp.hook)

One state class per registered method (written by tools/generate_faces.py into ddp_methods.py, as
for the Horovod face), one hook function (ddp_state.py, with the machinery); the engine and the
methods are the same code as under Horovod, driven by ``comm/torch_distributed.py`` on a process
group of the state's own (docs/ddp.md).
"""

from . import ddp_baselines, ddp_methods
from .ddp_baselines import DGC, GaussianK, RandomK, Threshold, TopK
from .ddp_methods import DEFT, LAGS, ExDyna, MiCRO
from .ddp_state import SparseHookState, hook

FACES = {**ddp_methods.FACES, **ddp_baselines.FACES}

__all__ = ["DEFT", "DGC", "FACES", "LAGS", "ExDyna", "GaussianK", "MiCRO", "RandomK", "SparseHookState",
           "Threshold", "TopK", "hook"]
