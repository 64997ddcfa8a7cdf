"""hvd_sparse.torch.optim: torch's Adam and AdamW that apply the Adam path's updates.

Unlinked, or linked with nothing delivered this step, they are torch's optimizers bit for bit (a
one-rank Horovod job never calls the compressor); a delivered parameter moves by
``p <- p * (1 - lr * weight_decay) - lr * update``; what ``optimizer=`` accepts, refuses (naming the
fix) and warns about; and how the link survives Horovod's copy of the optimizer and
``load_state_dict``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import AdamPath
from hvd_sparse.faces import FaceBase
from hvd_sparse.torch import optim


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, before_step=None) -> list:
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 6, generator=generator)
        net(x).square().mean().backward()
        if before_step is not None:
            before_step()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("cls, stock, kwargs", [
    (optim.AdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (optim.Adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
    (optim.Adam, torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "betas": (0.8, 0.99)}),
    (optim.AdamW, torch.optim.AdamW, {"lr": 1e-2, "foreach": False}),
])
def test_without_delivered_updates_it_is_torchs_optimizer(cls, stock, kwargs):
    ours, theirs = model(), model()
    a = train(ours, cls(ours.parameters(), **kwargs), 6)
    b = train(theirs, stock(theirs.parameters(), **kwargs), 6)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_delivered_updates_are_applied_as_adamw_applies_its_own():
    net = model()
    opt = optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
    link = optim.link(opt, AdamPath())
    params = list(net.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    link.deliver(params[:2])           # the first two hold updates; the others are gradients
    shadow = copy.deepcopy(params[2:])
    stock = torch.optim.AdamW(shadow, lr=0.05, weight_decay=0.1)
    for s, p in zip(shadow, params[2:], strict=True):
        s.grad = p.grad.clone()
    opt.step()
    stock.step()
    for p, old in zip(params[:2], before[:2], strict=True):
        assert torch.equal(p.detach(), old.mul(1 - 0.05 * 0.1).add(p.grad, alpha=-0.05))
    assert all(torch.equal(p.detach(), s.detach()) for p, s in zip(params[2:], shadow, strict=True))
    assert all(p.grad is not None for p in params)          # the gradients are left in place
    assert not any(link.take(p) for p in params)             # a delivery is taken once
    assert opt.state[params[0]] == {}                        # no Adam state for delivered ones


def test_the_link_survives_horovods_copy_and_load_state_dict():
    """Horovod steps a new instance of a subclass built from the groups; load_state_dict
    replaces the groups: the link lives beside the parameters and follows both."""
    net = model()
    opt = optim.AdamW(net.parameters(), lr=0.1)
    link = optim.link(opt, AdamPath())
    copied = type("AdamW", (type(opt),), {})(opt.param_groups)
    copied.load_state_dict(copied.state_dict())
    params = list(net.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    link.deliver(params)
    copied.step()
    moved = [b * (1 - 0.1 * 0.01) - 0.1 for b in before]
    assert all(torch.equal(p.detach(), m) for p, m in zip(params, moved, strict=True))
    assert not optim.is_stock_adam(copied)


def test_what_optimizer_accepts_and_refuses():
    net = model()
    assert optim.adam_path_of(optim.AdamW(net.parameters(), betas=(0.8, 0.95), eps=1e-6)) == \
        AdamPath(0.8, 0.95, 1e-6)
    assert optim.adam_path_of(torch.optim.SGD(net.parameters(), lr=0.1)) is None
    assert optim.adam_path_of(None) is None
    for stock, name in ((torch.optim.AdamW, "hvd_sparse.torch.optim.AdamW"), (torch.optim.Adam, "optim.Adam"),
                        (torch.optim.NAdam, "optim.Adam"), (torch.optim.Adamax, "optim.Adam")):
        with pytest.raises(ConfigurationError, match=name):
            optim.adam_path_of(stock(net.parameters()))
    for kwargs, fix in (({"amsgrad": True}, "amsgrad=False"), ({"maximize": True}, "maximize=False"),
                        ({"differentiable": True}, "differentiable=False")):
        with pytest.raises(ConfigurationError, match=fix):
            optim.adam_path_of(optim.AdamW(net.parameters(), **kwargs))
    with pytest.raises(ConfigurationError, match="decoupled decay"):
        optim.adam_path_of(optim.Adam(net.parameters(), weight_decay=0.1))
    assert optim.adam_path_of(optim.Adam(net.parameters(), weight_decay=0.1, decoupled_weight_decay=True))
    groups = [{"params": [net[0].weight], "betas": (0.9, 0.99)}, {"params": [net[2].weight]}]
    with pytest.raises(ConfigurationError, match="the same"):
        optim.adam_path_of(optim.AdamW(groups))
    with pytest.raises(ConfigurationError, match="takes the torch optimizer"):
        optim.adam_path_of("adamw")


def test_stock_adam():
    net = model()
    assert optim.is_stock_adam(torch.optim.Adam(net.parameters()))
    assert not optim.is_stock_adam(torch.optim.SGD(net.parameters(), lr=0.1))
    ours = optim.AdamW(net.parameters())
    assert optim.is_stock_adam(ours)          # not linked: it steps like torch's
    optim.link(ours, AdamPath())
    assert not optim.is_stock_adam(ours)


class _Face(optim.LinksTorchOptimizer, FaceBase):
    framework = "torch"


@pytest.mark.parametrize("name", ["TopK", "ExDyna"])
def test_a_face_warns_once_about_adam_stepping_without_the_path(name):
    from hvd_sparse import algorithms

    net = model()
    face = _Face(getattr(algorithms, name)(0.01))
    with pytest.warns(RuntimeWarning, match="without the Adam path.*optimizer="):
        face._note_optimizer(torch.optim.AdamW(net.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        face._note_optimizer(torch.optim.AdamW(net.parameters()))     # once
        opt = optim.AdamW(net.parameters())
        linked = _Face(getattr(algorithms, name)(0.01, adam=AdamPath()), optimizer=opt)
        linked._note_optimizer(opt)                                   # on the path: silent
        _Face(getattr(algorithms, name)(0.01))._note_optimizer(torch.optim.SGD(net.parameters(), lr=1))


def test_a_face_refuses_a_method_built_without_the_path_it_is_given():
    net = model()
    from hvd_sparse.algorithms import TopK
    with pytest.raises(ConfigurationError, match="optimizer=opt"):
        _Face(TopK(0.01), optimizer=optim.AdamW(net.parameters()))
