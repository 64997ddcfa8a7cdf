"""Adam and AdamW for the Adam path (docs/methods.md#adam-and-adamw), under torch's names and arguments.

    import hvd_sparse.torch as hs
    opt = hs.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    compression = hs.ExDyna(density=0.01, named_parameters=model.named_parameters(), optimizer=opt)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)

With ``optimizer=`` the compressor computes Adam itself (``hvd_sparse.algorithms.AdamPath``): its
result is Adam's update m_hat / (sqrt(v_hat) + eps) averaged over ranks, not a gradient. These
classes apply such an update as AdamW applies its own, ``p <- p - lr * (update + weight_decay * p)``,
to every parameter whose gradient the linked compressor delivered in this step, and are torch's
Adam/AdamW for every other parameter: on one rank (where Horovod never calls the compressor),
before the compressor is linked, or for parameters it does not serve.

The link lives beside the parameters (a weak mapping parameter -> link), not in the optimizer:
``hvd.DistributedOptimizer(opt)`` steps a new instance of a subclass of ``opt``'s class built from
``opt.param_groups``, with a state of its own, and ``load_state_dict`` replaces the groups; both
keep the parameters.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch

from ..algorithms.corrections import AdamPath
from ..errors import ConfigurationError

# id(parameter) -> (a weak reference to it, its link): weak, so a dropped model leaves nothing
# behind (a WeakKeyDictionary would compare tensors with ==, which torch makes element-wise).
_LINKS: dict[int, tuple[weakref.ref, AdamLink]] = {}


def _link_of(param: torch.Tensor) -> AdamLink | None:
    entry = _LINKS.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


class AdamLink:
    """Between a compressor on the Adam path and the optimizer that applies its updates: which
    parameters' gradients hold this step's update (``deliver``), taken by the optimizer's step."""

    def __init__(self, path: AdamPath):
        self.path = path
        self._fresh: set[int] = set()

    def deliver(self, params: Any) -> None:
        """The gradients of ``params`` now hold this step's averaged update."""
        self._fresh.update(id(p) for p in params)

    def take(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient holds a delivered update (forgotten once taken)."""
        if id(param) in self._fresh:
            self._fresh.discard(id(param))
            return True
        return False


class _AppliesUpdates:
    """The Adam path's step, before torch's: delivered updates are applied as AdamW applies its
    own; torch's Adam/AdamW steps every other parameter."""

    param_groups: list[dict[str, Any]]   # the torch optimizer's this class mixes into

    def step(self, closure: Any = None) -> Any:
        """Apply the delivered updates, then torch's step to the other parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden = []
        with torch.no_grad():
            for group in self.param_groups:
                decay = float(group["weight_decay"]) if _decoupled(group) else 0.0
                for p in group["params"]:
                    link = _link_of(p)
                    if p.grad is None or link is None or not link.take(p):
                        continue
                    lr = float(group["lr"])
                    if decay:
                        p.mul_(1.0 - lr * decay)
                    p.add_(p.grad.to(p.dtype), alpha=-lr)
                    hidden.append((p, p.grad))
                    p.grad = None   # torch's step leaves a parameter without gradient alone
        try:
            if any(p.grad is not None for group in self.param_groups for p in group["params"]):
                super().step()  # type: ignore[misc]  # torch's Adam/AdamW
        finally:
            for p, grad in hidden:
                p.grad = grad
        return loss


class Adam(_AppliesUpdates, torch.optim.Adam):
    """``torch.optim.Adam`` (the same arguments) that applies the Adam path's updates: link it
    with ``optimizer=`` of an hvd_sparse compressor. ``weight_decay`` needs
    ``decoupled_weight_decay=True`` on the path (that is AdamW)."""


class AdamW(_AppliesUpdates, torch.optim.AdamW):
    """``torch.optim.AdamW`` (the same arguments) that applies the Adam path's updates: link it
    with ``optimizer=`` of an hvd_sparse compressor."""


def _decoupled(group: dict) -> bool:
    return bool(group.get("decoupled_weight_decay", False))


def adam_path_of(optimizer: Any) -> AdamPath | None:
    """The ``AdamPath`` of an optimizer given as ``optimizer=``: one of this module's classes;
    None for an optimizer the path does not concern (SGD and the like: its gradients stay
    gradients). Raises ``ConfigurationError`` naming what to use for an Adam-style optimizer the
    path cannot serve."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"optimizer= takes the torch optimizer the compressor serves, got {optimizer!r}")
    if not isinstance(optimizer, _AppliesUpdates):
        if isinstance(optimizer, torch.optim.Adam) or _has_betas(optimizer):
            name = type(optimizer).__name__
            target = "AdamW" if isinstance(optimizer, torch.optim.AdamW) else "Adam"
            raise ConfigurationError(
                f"optimizer={name}(...) cannot apply the Adam path's updates (torch's {name} would "
                f"normalise the already normalised update again): build it as "
                f"hvd_sparse.torch.optim.{target}(...) with the same arguments"
                + ("" if isinstance(optimizer, torch.optim.Adam) else
                   f" ({name} itself has no Adam path; AdamW is the nearest)"))
        return None
    return _path_of_groups(optimizer.param_groups, type(optimizer).__name__)


def _path_of_groups(groups: list[dict], name: str) -> AdamPath:
    """One ``AdamPath`` for every parameter group, refusing what the path cannot apply."""
    paths = set()
    for group in groups:
        for option, fix in (("amsgrad", "amsgrad=False (the path freezes the second moment after its "
                                        "dense steps, so its running maximum has nothing to do)"),
                            ("maximize", "maximize=False (minimise the negated objective)"),
                            ("differentiable", "differentiable=False"),
                            ("capturable", "capturable=False")):
            if group.get(option):
                raise ConfigurationError(f"{name}({option}=True) cannot run the Adam path: use {fix}")
        if group.get("weight_decay") and not _decoupled(group):
            raise ConfigurationError(
                f"{name}(weight_decay={group['weight_decay']}) adds the decay to the gradient, inside "
                "Adam's moments, which the path computes in the compressor without the parameters: "
                "use hvd_sparse.torch.optim.AdamW(weight_decay=...) (decoupled decay, applied by the "
                "optimizer)")
        beta1, beta2 = (float(b) for b in group["betas"])
        paths.add(AdamPath(beta1, beta2, float(group["eps"])))
    if len(paths) != 1:
        raise ConfigurationError(
            f"the parameter groups of {name} have different betas or eps ({sorted(map(repr, paths))}): "
            "the Adam path takes one of each; give every group the same")
    return paths.pop()


def _has_betas(optimizer: torch.optim.Optimizer) -> bool:
    return any("betas" in group for group in optimizer.param_groups)


def _forget(key: int, _: Any) -> None:
    """A linked parameter is gone: its entry goes too."""
    _LINKS.pop(key, None)


def link(optimizer: Any, path: AdamPath) -> AdamLink:
    """Link ``optimizer``'s parameters to a new ``AdamLink`` for ``path`` (a compressor's)."""
    shared = AdamLink(path)
    for group in optimizer.param_groups:
        for p in group["params"]:
            key = id(p)
            _LINKS[key] = (weakref.ref(p, partial(_forget, key)), shared)
    return shared


def is_stock_adam(optimizer: Any) -> bool:
    """An Adam-style torch optimizer that steps without the Adam path: torch's own (Adam, AdamW,
    NAdam, ...), or one of this module's whose parameters no compressor linked."""
    if not isinstance(optimizer, torch.optim.Optimizer) or not _has_betas(optimizer):
        return False
    if not isinstance(optimizer, _AppliesUpdates):
        return True
    return not any(_link_of(p) is not None for group in optimizer.param_groups for p in group["params"])


class LinksTorchOptimizer:
    """What both PyTorch faces (Horovod's compressor, the DDP state) do with ``optimizer=``:
    FaceBase's hooks for torch optimizers, and the delivery of each step's updates."""

    _adam_link: AdamLink | None   # FaceBase's, which this class mixes into

    @classmethod
    def adam_path_of(cls, optimizer: Any) -> AdamPath | None:
        """``FaceBase.adam_path_of`` for torch optimizers (``adam_path_of`` above)."""
        if isinstance(optimizer, AdamPath):
            return optimizer
        return adam_path_of(optimizer)

    def _link_optimizer(self, optimizer: Any, path: AdamPath) -> AdamLink | None:
        return link(optimizer, path) if isinstance(optimizer, torch.optim.Optimizer) else None

    def _momentum_of(self, optimizer: Any) -> str | None:
        return optimizer_momentum(optimizer)

    def _is_stock_adam(self, optimizer: Any) -> bool:
        return is_stock_adam(optimizer)

    def _deliver(self, params: Any) -> None:
        """The gradients of ``params`` hold this step's Adam path update (for the optimizer)."""
        if self._adam_link is not None:
            self._adam_link.deliver(params)


def optimizer_momentum(optimizer: Any) -> str | None:
    """How a torch optimizer applies momentum of its own, or None: ``momentum`` > 0 in a parameter
    group (SGD, RMSprop), or Adam-style ``betas`` with beta1 > 0 (Adam, AdamW, NAdam, RAdam,
    Adamax): beta1's moving average of the gradient is a momentum too, and on top of the momentum
    correction it averages an already averaged gradient."""
    name = type(optimizer).__name__
    for group in getattr(optimizer, "param_groups", ()):
        if _positive(group.get("momentum")):
            return f"{name}(momentum={float(group['momentum'])})"
        betas = group.get("betas")
        if isinstance(betas, (tuple, list)) and betas and _positive(betas[0]):
            return f"{name}(betas=({', '.join(str(float(b)) for b in betas)}))"
    return None


def _positive(value: Any) -> bool:
    """A number (or one-element tensor) above zero."""
    try:
        return value is not None and not isinstance(value, bool) and float(value) > 0
    except (TypeError, ValueError, RuntimeError):
        return False
