"""The DDP face: every hvd_sparse method as a DistributedDataParallel communication hook.

    import hvd_sparse.torch.ddp as ddp
    model = DistributedDataParallel(model)
    state = ddp.ExDyna(density=0.001, named_parameters=model.module.named_parameters())
    model.register_comm_hook(state, ddp.hook)

One state class per registered method (written by tools/generate_faces.py into ddp_methods.py and
its siblings, as for the Horovod face), one hook function (ddp_state.py; the worker's step in
ddp_steps.py); the engine and the methods are the same code as under Horovod, driven by
``comm/torch_distributed.py`` on a process group of the state's own (docs/ddp.md).
"""

from . import ddp_baselines, ddp_layerwise, ddp_methods, ddp_simple_baselines
from .ddp_baselines import DGC, GaussianK, TopK
from .ddp_layerwise import DEFT, LAGS
from .ddp_methods import ExDyna, MiCRO
from .ddp_simple_baselines import RandomK, Threshold
from .ddp_state import SparseHookState, hook

FACES = {**ddp_methods.FACES, **ddp_layerwise.FACES, **ddp_baselines.FACES,
         **ddp_simple_baselines.FACES}

__all__ = ["DEFT", "DGC", "FACES", "LAGS", "ExDyna", "GaussianK", "MiCRO", "RandomK", "SparseHookState",
           "Threshold", "TopK", "hook"]
