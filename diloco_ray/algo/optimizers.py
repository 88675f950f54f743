"""The job's two optimizers, and the one place that turns a name into a ``torch.optim`` class.

``inner_opt`` runs on every rank (AdamW by default); ``outer_opt`` is the outer step the
parameter server takes (SGD with Nesterov momentum, DiLoCo's recipe). A name that is not
a ``torch.optim`` optimizer, or kwargs its class rejects, is a ConfigError naming the
field: the preflight builds both over a dummy parameter, so a typo fails before Ray starts.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import torch

from diloco_ray.config.sections import InnerOptimSection, OuterOptimSection
from diloco_ray.errors import ConfigError


def optimizer_class(field: str, name: str) -> type[torch.optim.Optimizer]:
    """``torch.optim.<name>``, or a ConfigError naming ``field`` and the closest names."""
    cls = getattr(torch.optim, str(name), None)
    if _is_optimizer(cls):
        return cls
    known = sorted(n for n, c in vars(torch.optim).items() if _is_optimizer(c))
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"{field}: '{name}' is not a torch.optim optimizer{hint}; allowed: {', '.join(known)}")


def _is_optimizer(cls: Any) -> bool:
    return inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer


def build_inner_optimizer(params, inner: InnerOptimSection) -> torch.optim.Optimizer:
    """``torch.optim.<inner_opt>(params, lr=lr, **inner_opt_kwargs)``."""
    cls = optimizer_class("inner_opt", inner.inner_opt)
    try:
        return cls(params, **{"lr": inner.lr, **inner.inner_opt_kwargs})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"inner_opt_kwargs: {e} (for {inner.inner_opt})") from None


def build_outer_optimizer(params: list[torch.Tensor], outer: OuterOptimSection) -> torch.optim.Optimizer:
    """``torch.optim.<outer_opt>`` over ``params`` with ``outer_lr``, ``outer_momentum``
    (where the class takes one, Nesterov for SGD) and ``outer_opt_kwargs``."""
    cls = optimizer_class("outer_opt", outer.outer_opt)
    extra = dict(outer.outer_opt_kwargs or {})
    signature = inspect.signature(cls.__init__).parameters
    kwargs: dict[str, Any] = {"lr": float(outer.outer_lr)}
    if "momentum" in signature:
        kwargs["momentum"] = float(outer.outer_momentum)
    kwargs.update(extra)
    # DiLoCo's recipe is Nesterov outer momentum; decide from the effective momentum
    # so that a kwargs override to momentum=0 (or dampening) does not make SGD raise.
    if cls is torch.optim.SGD and "nesterov" not in extra:
        if kwargs.get("momentum", 0) > 0 and kwargs.get("dampening", 0) == 0:
            kwargs["nesterov"] = True
    # The fused kernel updates in place: the per-parameter optimizer's Nesterov term is a
    # full-size temporary (the server's peak would hold it), and the fused one is faster on
    # CPU too.
    if (
        "fused" in signature
        and not {"fused", "foreach"} & set(extra)
        and all(p.dtype == torch.float32 and p.device.type in ("cpu", "cuda") for p in params)
    ):
        kwargs["fused"] = True
    try:
        optimizer = cls(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"outer_opt_kwargs: {e} (for {outer.outer_opt})") from None
    if outer.outer_momentum_warmup_rounds and "momentum" not in optimizer.defaults:
        raise ConfigError(
            f"outer_momentum_warmup_rounds: {outer.outer_opt} has no momentum to warm up (set 0, or an outer_opt "
            "with a momentum such as SGD)"
        )
    return optimizer
